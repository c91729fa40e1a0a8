"""What a checkpoint holds for one rank: the state a script registered (`Run.register`), as the flat, named
items torch.distributed.checkpoint writes, and the way back into the live objects.

Model and optimizer go through `torch.distributed.checkpoint.state_dict` (`get_state_dict`/`set_state_dict`):
keys are parameter names whatever the optimizer (AdamW, SGD, Adafactor...) and whatever the wrapping (plain,
DDP, FSDP2's `fully_shard`, whose DTensors DCP reshards to any world size). Extras and the RNG are per rank:
`extras.<rank>.<name>` holds what the extra's `state_dict()` returned, pickled as one item, so a rank restores
its own (rank 0's when the saving job had no such rank)."""

import io
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


@runtime_checkable
class Stateful(Protocol):
    """Anything with the two methods torch's own objects have: a data loader position, a sampler, a counter."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _pack(value: object) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpack(value: object) -> Any:
    if not isinstance(value, bytes | bytearray):
        raise TypeError(f"expected the pickled bytes of an extra, got {type(value).__name__}")
    return torch.load(io.BytesIO(value), weights_only=False)  # verified against the manifest's sha256 first


class TrainState:
    """The registered model, optimizer and extras of one rank."""

    def __init__(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None,
                 extras: Mapping[str, Stateful], *, rank: int, device: torch.device) -> None:
        if model is None and optimizer is not None:
            raise TypeError("register(optimizer=...) needs the model it optimizes: register(model, optimizer)")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"register(model=...) takes a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"register(optimizer=...) takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for name, extra in extras.items():
            if not name.isidentifier():
                raise ValueError(f"register(...): extra name {name!r} must be a Python identifier")
            if not isinstance(extra, Stateful):
                raise TypeError(f"register({name}=...) needs an object with state_dict() and load_state_dict(), "
                                f"got {type(extra).__name__}")
        self.model, self.optimizer, self.extras = model, optimizer, dict(extras)
        self.rank, self.device = rank, device

    def _model_state(self) -> dict[str, Any]:
        if self.model is None:
            return {}
        optims = (self.optimizer,) if self.optimizer is not None else ()
        model_sd, optim_sd = get_state_dict(self.model, optims)
        return {"model": model_sd, "optim": optim_sd} if optims else {"model": model_sd}

    def live(self) -> dict[str, Any]:
        """The flat items to save now: the live tensors themselves (the checkpointer copies them), extras packed."""
        flat, _ = flatten_state_dict(self._model_state())
        flat[f"rng.cpu.{self.rank}"] = torch.get_rng_state()
        if self.device.type == "cuda":
            flat[f"rng.cuda.{self.rank}"] = torch.cuda.get_rng_state(self.device)
        for name, extra in self.extras.items():
            flat[f"extras.{self.rank}.{name}"] = _pack(extra.state_dict())
        return flat

    def load_target(self, saved: Mapping[str, object]) -> dict[str, Any]:
        """What to load, nested as `get_state_dict` gives it (DCP loads into it in place): the model and
        optimizer items (all required), this rank's RNG and extras when they were saved."""
        dest: dict[str, Any] = self._model_state()
        for kind in ("cpu", "cuda"):
            key = f"rng.{kind}.{self.rank}"
            md = saved.get(key)
            if isinstance(md, TensorStorageMetadata):
                dest[key] = torch.empty(md.size, dtype=md.properties.dtype)
        for name in self.extras:
            # its own, else rank 0's, else the lowest rank's that was saved (a set persisted after rank 0's node
            # was lost has no rank 0)
            held = sorted(int(k.split(".")[1]) for k, v in saved.items()
                          if k.startswith("extras.") and k.endswith(f".{name}") and isinstance(v, BytesStorageMetadata)
                          and k.split(".")[1].isdigit())
            for rank in (self.rank, 0, *held[:1]):
                key = f"extras.{rank}.{name}"
                if isinstance(saved.get(key), BytesStorageMetadata):
                    dest[key] = b""
                    break
        return dest

    def apply(self, loaded: dict[str, Any]) -> None:
        """Put what `load_target` received into the live objects."""
        if self.model is not None:
            optims = (self.optimizer,) if self.optimizer is not None else ()
            set_state_dict(self.model, optims, model_state_dict=loaded["model"],
                           optim_state_dict=loaded.get("optim", {}))
        if (cpu := loaded.get(f"rng.cpu.{self.rank}")) is not None:
            torch.set_rng_state(cpu)
        if (cuda := loaded.get(f"rng.cuda.{self.rank}")) is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(cuda, self.device)
        for name, extra in self.extras.items():
            value = next((v for k, v in loaded.items() if k.startswith("extras.") and k.endswith(f".{name}")), None)
            if value is not None:  # load_target asked for exactly one rank's
                extra.load_state_dict(_unpack(value))


def keys(state: dict[str, Any]) -> set[str]:
    """The item names DCP gives a (nested) state dict."""
    return set(flatten_state_dict(state)[0])
