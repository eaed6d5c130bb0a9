"""Packaging hook (metadata lives in pyproject.toml): ship the QUADS_CONFIG startup hook.

build_py also writes ``quads_megatron_startup.pth`` at the root of what gets installed into
site-packages: build_lib for a wheel, the editable wheel's root for ``pip install -e``. Its one
line runs at interpreter start and does nothing unless QUADS_CONFIG is set (quads_megatron/_startup.py).
"""

import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py

_HERE = os.path.dirname(os.path.abspath(__file__))


def _startup_module():
    """quads_megatron/_startup.py loaded on its own (stdlib only), for PTH_NAME and PTH_LINE."""
    path = os.path.join(_HERE, "src", "quads_megatron", "_startup.py")
    spec = importlib.util.spec_from_file_location("_quads_startup_for_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class build_py_with_startup_hook(build_py):
    """build_py + the startup .pth at the site-packages root of the wheel (regular or editable)."""

    def run(self):
        super().run()
        startup = _startup_module()
        if self.editable_mode:  # setuptools' editable wheel: install_lib is the wheel's root
            root = self.get_finalized_command("install").install_lib
        else:
            root = self.build_lib
        os.makedirs(root, exist_ok=True)
        target = os.path.join(root, startup.PTH_NAME)
        with open(target, "w", encoding="utf-8") as f:
            f.write(startup.PTH_LINE)
        self._startup_pth = target

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        target = getattr(self, "_startup_pth", None)
        return outputs + [target] if target and not self.editable_mode else outputs


setup(cmdclass={"build_py": build_py_with_startup_hook})
