"""recaccel.train and recaccel.train.distributed name their public API; importing either
loads neither torch nor TorchRec (TorchRec is optional; ``import recaccel`` stays light)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = ["recaccel.train", "recaccel.train.distributed"]


def test_importing_the_train_packages_loads_no_torch_or_torchrec():
    probe = (
        "import sys; import recaccel.train, recaccel.train.distributed; "
        "print(sorted(m for m in ('torch', 'torchrec', 'fbgemm_gpu') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("name", PACKAGES)
def test_every_listed_name_resolves_to_its_module(name):
    package = importlib.import_module(name)
    assert package.__all__ == sorted(package.__all__)
    assert set(package.__all__) == set(package._EXPORTS)
    for attr in package.__all__:
        value = getattr(package, attr)
        defining = importlib.import_module(f"{name}.{package._EXPORTS[attr]}")
        assert value is getattr(defining, attr), attr
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        package.nothing  # noqa: B018
