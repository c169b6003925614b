"""The synchronous step asks its server link for the step's sync early: once the batch is collected, before the update
(`vlmreg.inference.server_link.ServerLink.post_early`; what a vLLM does with it is tested in
tests/inference/test_vllm_server.py)."""

from __future__ import annotations

from tests.train.test_trainer_options import make_trainer


def test_the_synchronous_step_asks_for_its_sync_between_the_collection_and_the_update(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "trainer.steps=1")
    order: list[tuple[str, int]] = []

    class Link:  # what the trainer asks of its link to a server apart
        def post_early(self, step: int) -> bool:
            order.append(("post_early", step))
            return True

        def settle(self) -> None:
            order.append(("settle", 0))

        def timed_sync(self, step: int) -> dict[str, float]:
            order.append(("sync", step))
            return {"sync_s": 0.0}

    collect, update = trainer.collect, trainer.update

    def collecting(step, version=None):
        batch = collect(step, version)
        order.append(("collected", step))
        return batch

    def updating(batch):
        order.append(("update", batch.step))
        return update(batch)

    monkeypatch.setattr(trainer, "collect", collecting)
    monkeypatch.setattr(trainer, "update", updating)
    trainer.link = Link()
    try:
        record = trainer.train_step(1)
    finally:
        trainer.link = None
        trainer.cleanup()
    assert order == [("collected", 1), ("post_early", 1), ("update", 1), ("settle", 0), ("sync", 1)]
    assert record.metrics["sync_s"] == 0.0
