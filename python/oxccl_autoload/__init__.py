"""Makes the torch.distributed backend name "oxccl" known in every process that imports torch,
with no ``import oxccl`` in the user's code (``dist.init_process_group("oxccl")``,
``new_group(backend="oxccl")``, DeviceMesh, Ray Train's ``TorchConfig(backend="oxccl")``).

torch calls :func:`register` at ``import torch`` (the ``torch.backends`` entry point group,
``torch._import_device_backends``; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns every such entry
point off). It must stay cheap and must not fail: it only records the name and a creator with
``Backend.register_backend``. oxccl itself (its Rust extension, the C++ torch backend and its
build) is loaded by that creator, when the first group with this backend is made.

This is a top-level package, not ``oxccl.<something>``: importing any module of ``oxccl``
runs ``oxccl/__init__.py``, which loads the Rust extension.
"""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "oxccl"


def _create(dist_opts: Any, backend_options: Any = None) -> Any:
    """torch's creator for the backend: imports oxccl.torch (which registers its own creator
    in place of this one) and hands the call to it."""
    from oxccl import torch as oxccl_torch

    return oxccl_torch._create(dist_opts, backend_options)


def register() -> None:
    """The entry point torch calls during ``import torch``. Never raises: torch would turn
    any exception into a failed ``import torch``; then the backend is simply not known, and
    ``import oxccl.torch`` still registers it (and shows what is wrong)."""
    try:
        import sys

        # torch/__init__.py imports torch.distributed before it runs the entry points.
        dist = sys.modules.get("torch.distributed")
        if dist is None:
            import torch.distributed as dist
        if not dist.is_available():
            return
        backend = dist.Backend
        if BACKEND_NAME in backend.backend_list:  # oxccl.torch was imported first
            return
        backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
        # oxccl keeps its own flight records (as oxccl.torch says when it is imported).
        fr_self = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
        if isinstance(fr_self, set):
            fr_self.add(BACKEND_NAME)
    except Exception as e:  # noqa: BLE001 - a broken autoload must not break `import torch`
        import warnings

        warnings.warn(
            f"oxccl: could not register the torch.distributed backend 'oxccl' at import torch ({e!r}); "
            "`import oxccl.torch` registers it",
            stacklevel=2,
        )
