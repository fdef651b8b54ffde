"""unbroken's torchtitan checkpoint manager refuses what it does not do, with what to do, before
it touches anything; ``adopt`` carries torchtitan's own checkpoint settings over."""

from __future__ import annotations

import pytest

titan = pytest.importorskip(
    "unbroken.integrations.torchtitan",
    reason="the torchtitan extra: pip install 'unbroken[torchtitan]'",
    exc_type=ImportError,
)
pytestmark = pytest.mark.slow  # imports torchtitan (seconds)

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402

from unbroken.restart import RestartContext  # noqa: E402

Checkpoint = titan.Checkpoint
CTX = object.__new__(RestartContext)  # never called: the refusals come first


def _build(config: object, parts: int = 1) -> None:
    Checkpoint(
        config,
        dataloader=None,
        model_parts=[object()] * parts,
        optimizers=None,
        lr_schedulers=None,
        states={},
    )


def test_adopt_carries_torchtitans_settings_and_the_context() -> None:
    own = CheckpointManager.Config(enable=True, interval=7, folder="ck", keep_latest_k=3)
    ours = Checkpoint.adopt(own, CTX)
    assert (ours.enable, ours.interval, ours.folder, ours.keep_latest_k) == (True, 7, "ck", 3)
    assert ours._ctx is CTX
    assert "_ctx" not in ours.to_dict() and ours.to_dict()["interval"] == 7
    assert Checkpoint.Config().enable  # on unless told: the memory tier and the steps need it
    assert ours._owner is Checkpoint  # torchtitan's config.build() makes ours
    assert Checkpoint.adopt(ours, CTX)._ctx is CTX  # a config of ours adopted again


def test_without_a_context_it_says_how_to_adopt() -> None:
    with pytest.raises(ValueError, match=r"Checkpoint\.adopt\(config\.checkpoint, ctx\)"):
        _build(Checkpoint.Config())


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("initial_load_path", "/elsewhere/step-10", "restore another run's weights"),
        ("create_seed_checkpoint", True, "torchtitan's own CheckpointManager"),
        ("exclude_from_loading", ["dataloader"], "the whole state, or nothing"),
        ("load_only", True, "enable=False"),
        ("load_step", 30, "leave load_step at -1"),
    ],
)
def test_a_torchtitan_feature_it_does_not_do_is_refused(field: str, value: object, says: str):
    config = Checkpoint.adopt(CheckpointManager.Config(), CTX)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"checkpoint.{field}") as e:
        _build(config)
    assert says in str(e.value)


def test_pipeline_parallel_model_parts_are_refused() -> None:
    with pytest.raises(ValueError, match="2 model parts"):
        _build(Checkpoint.adopt(CheckpointManager.Config(), CTX), parts=2)
