"""A training script whose configuration is wrong: ``unbroken.main`` with an ``fn`` that raises
``ValueError`` while setting up (before its first step)."""

import unbroken


def train(ctx: unbroken.RestartContext) -> None:
    raise ValueError("--lr must be > 0, got -1")


if __name__ == "__main__":
    unbroken.main(train)
