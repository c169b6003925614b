import sys

from vlmreg.cli import main

sys.exit(main())
