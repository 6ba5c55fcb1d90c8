"""IMPORT-ONLY STAND-IN for NVIDIA Transformer Engine. Not Transformer Engine.

Used by one thing only: the local preflight venv that docker/bridge_venv.sh builds, on a
machine without CUDA, where Transformer Engine's torch extension cannot be built. It lets
``import megatron.bridge`` (the config, the recipes, the override code) succeed so that
jobscripts/bridge_preflight.py can run Bridge's own config code. It never goes into a
training image, the project's package or the production path: there, the NeMo container's
real Transformer Engine is imported.

Any name under ``transformer_engine`` resolves to a placeholder class: it can be imported,
subclassed and looked up (``te.pytorch.Linear``, ``te.common.recipe.Format.E4M3``), and it
raises ``StandInUsed`` the moment anything calls it. So no computation can silently run on it;
a preflight that reached one would fail loudly, naming it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

# megatron.core reads this to decide which TE code paths exist; the version Bridge 0.6.2's
# checks accept. A check that depends on the real library is not verified by preflight.
__version__ = "2.9.0"
STAND_IN = True


class StandInUsed(RuntimeError):
    """Something tried to compute with the import-only Transformer Engine stand-in."""


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")


def _placeholder(qualname: str) -> type:
    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise StandInUsed(f"{qualname} is part of the import-only transformer_engine stand-in "
                          "(docker/standins/): it cannot run")

    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {
        "__qualname__": qualname, "__module__": __name__, "__init__": refuse,
        "__call__": refuse})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``transformer_engine.<sub>`` module is a stand-in module too."""

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name, "import-only transformer_engine stand-in")
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        return None


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _StandInModule
