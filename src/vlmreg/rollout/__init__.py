"""The episode runner: a run's environments played against a rollout engine, turn by turn, into trajectories
(`episodes`), with the images each episode may carry counted (`image_budget`).

The engines are `vlmreg.inference`'s; the environments `vlmreg.envs`'; the engine protocol (`RolloutEngine`,
`SamplingParams`, `PromptRequest`, `Completion`) is the SDK's (`vlmreg.sdk.engine`).
"""
