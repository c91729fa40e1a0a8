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

import structlog
import torch
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from flightdeck.trainer import untouched
from flightdeck.trainer.usage import refused


@runtime_checkable
class Stateful(Protocol):
    """Anything with the two methods torch's own objects have: a data loader position, a sampler, a counter."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _pack(value: object) -> bytes:
    buf = io.BytesIO()
    # the legacy pickle format: a fifth of the zip format's time for a small extra (torch.load reads both)
    torch.save(value, buf, _use_new_zipfile_serialization=False)
    return buf.getvalue()


def _unpack(value: object) -> Any:
    if not isinstance(value, bytes | bytearray):
        raise TypeError(f"expected the pickled bytes of an extra, got {type(value).__name__}")
    return torch.load(io.BytesIO(value), weights_only=False)  # verified against the manifest's sha256 first


log = structlog.get_logger("trainer")


class TrainState:
    """The registered model, optimizer and extras of one rank."""

    def __init__(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None,
                 extras: Mapping[str, Stateful], *, rank: int, device: torch.device) -> None:
        if model is None and optimizer is not None:
            raise refused(TypeError("register(optimizer=...) needs the model it optimizes: "
                                    "register(model, optimizer)"))
        if model is not None and not isinstance(model, nn.Module):
            raise refused(TypeError(f"register(model=...) takes a torch.nn.Module, got {type(model).__name__}"))
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise refused(TypeError(f"register(optimizer=...) takes a torch.optim.Optimizer, "
                                    f"got {type(optimizer).__name__}"))
        for name, extra in extras.items():
            if not name.isidentifier():
                raise refused(ValueError(f"register(...): extra name {name!r} must be a Python identifier"))
            if not isinstance(extra, Stateful):
                hint = "; a data loader goes to run.batches(loader) instead" if hasattr(extra, "__iter__") else ""
                raise refused(TypeError(f"register({name}=...) needs an object with state_dict() and "
                                        f"load_state_dict(), got {type(extra).__name__}{hint}"))
        self.model, self.optimizer, self.extras = model, optimizer, dict(extras)
        self.rank, self.device = rank, device
        # get_state_dict's flat items, while the same tensors hold the state (see _gathered)
        self._gathered_for: tuple[tuple[int, ...], ...] | None = None
        self._flat: dict[str, Any] = {}
        self._groups: dict[str, tuple[int, str]] = {}  # optim.param_groups.<i>.<name> -> (i, name), read fresh
        self._settled: tuple[tuple[tuple[int, ...], ...] | None, frozenset[str]] = (None, frozenset())
        self._own_groups: list[list[str]] = []  # each optimizer group's parameter names here (load_target)
        self._fresh_saved = False  # the checkpoint being loaded holds no optimizer state (load_target)
        # Counts the gathers that found other tensors, or other memory, than the one before: two gathers of one
        # generation hold the same tensors over the same memory (a snapshot's layout and copy plan stand)
        self.generation = 0
        self.loaded_meta: dict[str, Any] = {}  # the last loaded checkpoint's own record (checkpointing.load)
        self.borrowed: dict[str, int] = {}  # extras the last load took from another rank's copy: name -> that rank

    def _model_state(self) -> tuple[dict[str, Any], bool]:
        """get_state_dict's nested items, and whether the optimizer is fresh (no state yet: the items' optimizer
        state is what torch made up for it, and the optimizer holds none of it: trainer/untouched.py)."""
        if self.model is None:
            return {}, False
        optims = (self.optimizer,) if self.optimizer is not None else ()
        with untouched.untouched(self.optimizer) as fresh:
            model_sd, optim_sd = get_state_dict(self.model, optims)
        return ({"model": model_sd, "optim": optim_sd} if optims else {"model": model_sd}), fresh

    def _mark(self) -> tuple[tuple[int, ...], ...] | None:
        """Which tensor objects, over which memory, hold the model's and optimizer's state now. Every snapshot
        checks it, so it is built by C-level maps over lists, not a loop per tensor."""
        if self.model is None:
            return None
        tensors: list[Any] = _held(self.model)
        counts: tuple[int, ...] = ()
        others: tuple[int, ...] = ()
        if self.optimizer is not None:
            counts = tuple([len(group["params"]) for group in self.optimizer.param_groups])
            state: list[Any] = []
            for per_param in self.optimizer.state.values():
                state += per_param.values()
            tensors += [v for v in state if type(v) in _PLAIN or isinstance(v, torch.Tensor)]
            # a Python number: its object
            others = tuple([id(v) for v in state if type(v) not in _PLAIN and not isinstance(v, torch.Tensor)])
        # type() first: isinstance on a Parameter, and a getattr that fails, take three times as long
        memory = tuple(map(torch.Tensor.data_ptr, [t if type(t) in _PLAIN else getattr(t, "_local_tensor", t)
                                                   for t in tensors]))
        return tuple(map(id, tensors)), memory, counts, others

    def _gathered(self) -> dict[str, Any]:
        """get_state_dict's items, flat. Gathering them costs milliseconds (4.5 ms of a 130 ms step on the CPU
        example, every snapshot), so while the same tensors over the same memory hold the state they are reused,
        with the optimizer's param_groups read fresh (the learning rate moves); anything else not a tensor turns
        the reuse off."""
        mark = self._mark()
        if mark is not None and mark == self._gathered_for:
            flat = dict(self._flat)
            assert self.optimizer is not None or not self._groups
            for key, (i, name) in self._groups.items():
                flat[key] = self.optimizer.param_groups[i][name]  # type: ignore[union-attr]
            return flat
        nested, fresh = self._model_state()
        flat, _ = flatten_state_dict(nested)
        if fresh:  # saved as it is: groups, no state (a restore leaves the optimizer as fresh)
            flat = untouched.without_state(flat)
        groups: dict[str, tuple[int, str]] = {}
        for key, value in flat.items():
            parts = key.split(".")
            if len(parts) == 4 and parts[:2] == ["optim", "param_groups"] and parts[2].isdigit():
                if parts[3] != "params":
                    groups[key] = (int(parts[2]), parts[3])
            elif not isinstance(value, torch.Tensor):
                mark = None
        self._gathered_for, self._flat, self._groups = mark, flat, groups
        self.generation += 1
        return dict(flat)

    def settled(self, items: Mapping[str, Any]) -> frozenset[str]:
        """The keys of `items` (live()'s) that only the optimizer's step writes: the model's parameters and the
        optimizer's state, on the CPU. A snapshot may copy them while the step's forward and backward run. Buffers
        (BatchNorm's statistics, DDP's broadcast of them) are written by the forward pass: never among them."""
        if self.model is None or self.optimizer is None or self.device.type != "cpu":
            return frozenset()
        found_for, found = self._settled
        if self._gathered_for is not None and found_for == self._gathered_for and found <= items.keys():
            return found  # the same tensors as when they were last found
        ptrs = {getattr(p, "_local_tensor", p).data_ptr() for p in self.model.parameters()}
        ptrs |= {getattr(v, "_local_tensor", v).data_ptr() for per_param in self.optimizer.state.values()
                 for v in per_param.values() if isinstance(v, torch.Tensor)}
        keys = frozenset(k for k, v in items.items() if isinstance(v, torch.Tensor) and v.numel()
                         and getattr(v, "_local_tensor", v).data_ptr() in ptrs)
        self._settled = (self._gathered_for, keys)
        return keys

    def live(self) -> dict[str, Any]:
        """The flat items to save now: the live tensors themselves (the checkpointer copies them), extras packed."""
        flat = self._gathered()
        flat[f"rng.cpu.{self.rank}"] = torch.get_rng_state()
        if self.device.type == "cuda":
            flat[f"rng.cuda.{self.rank}"] = torch.cuda.get_rng_state(self.device)
        for name, extra in self.extras.items():
            flat[f"extras.{self.rank}.{name}"] = _pack(extra.state_dict())
        return flat

    def load_target(self, saved: Mapping[str, object], *, model_only: bool = False) -> dict[str, Any]:
        """What to load, nested as `get_state_dict` gives it (DCP loads into it in place): the model and
        optimizer items (all required), this rank's RNG and extras when they were saved; the model's alone with
        `model_only`."""
        self.borrowed = {}
        dest, _ = self._model_state()
        if model_only:
            return {"model": dest["model"]} if "model" in dest else {}
        # Which parameters each group holds is this rank's own: a checkpoint keeps one rank's list, and a pipeline
        # stage's is not another's (a restore into another layout once gave stage 0 stage 1's, and AdamW failed).
        self._own_groups = [list(g["params"]) for g in dest.get("optim", {}).get("param_groups", [])]
        # saved before the optimizer's first step: no state to load, and none to keep (a rollback to it)
        self._fresh_saved = "optim" in dest and not any(k.startswith(untouched.STATE_PREFIX) for k in saved)
        if self._fresh_saved:
            dest["optim"] = {"param_groups": dest["optim"]["param_groups"]}
        for kind in ("cpu", "cuda"):
            key = f"rng.{kind}.{self.rank}"
            md = saved.get(key)
            if isinstance(md, TensorStorageMetadata):
                dest[key] = torch.empty(md.size, dtype=md.properties.dtype)
            elif kind == "cpu" and any(k.startswith("rng.cpu.") for k in saved):  # the survivors' replicas alone
                log.warning("the checkpoint holds no RNG state of this rank (a set of other ranks' replicas): its "
                            "random stream restarts from the script's seeding", rank=self.rank)
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
                    if rank != self.rank:
                        self.borrowed[name] = rank
                    break
        return dest

    def apply(self, loaded: dict[str, Any], *, model_only: bool = False) -> None:
        """Put what `load_target` received into the live objects."""
        if self.model is not None and model_only:
            set_state_dict(self.model, (), model_state_dict=loaded["model"], optim_state_dict={})
            return
        if self.model is not None:
            optims = (self.optimizer,) if self.optimizer is not None else ()
            groups = loaded.get("optim", {}).get("param_groups", [])
            if len(groups) == len(self._own_groups):
                for group, own in zip(groups, self._own_groups, strict=True):
                    group["params"] = own
            if self._fresh_saved and self.optimizer is not None:
                set_state_dict(self.model, (), model_state_dict=loaded["model"], optim_state_dict={})
                untouched.set_groups(self.optimizer, groups)
            else:
                with untouched.untouched(self.optimizer, loading=True):
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


_PLAIN = frozenset({torch.Tensor, nn.Parameter})  # no DTensor: its own memory is its data_ptr's


def _held(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of the module tree, in a fixed order (a shared one as often as it is shared): what
    `parameters()` and `buffers()` give, without the names they build on the way, a third of a snapshot's gather."""
    found: list[torch.Tensor | None] = []
    stack: list[nn.Module | None] = [model]
    while stack:
        module = stack.pop()
        if module is None:  # a child set to None (a pipeline stage's dropped layers)
            continue
        found += module._parameters.values()
        found += module._buffers.values()
        stack += reversed(module._modules.values())
    return [t for t in found if t is not None]  # a module may register None (a Linear without bias)


def keys(state: dict[str, Any]) -> set[str]:
    """The item names DCP gives a (nested) state dict."""
    return set(flatten_state_dict(state)[0])
