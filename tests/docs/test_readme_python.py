"""The README's Python block runs as written (its training run shortened by one extra override)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_python_block_runs(tmp_path, monkeypatch, capsys):
    block = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert "vlmreg.train(" in block
    monkeypatch.chdir(ROOT)
    code = block.replace(
        'overrides=["trainer.steps=20"]',
        'overrides=["trainer.steps=2", "trainer.format_warmup_steps=0", "eval.every=0"]',
    )
    code = code.replace('output_dir="runs/py"', f'output_dir="{tmp_path / "py"}"')
    assert code != block
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    result = namespace["result"]
    assert result.step == 2 and result.checkpoint is not None and result.checkpoint.exists()
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()] == ["1", "2"]
