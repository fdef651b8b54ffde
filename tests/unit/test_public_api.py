from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_public_api_resolves_and_import_is_light() -> None:
    code = (
        "import sys, unbroken\n"
        "assert 'torch' not in sys.modules, 'import unbroken imported torch'\n"
        "assert len(unbroken.__all__) <= 13\n"
        "for name in unbroken.__all__: getattr(unbroken, name)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
