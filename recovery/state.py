"""State providers: turn training components into named tensors plus JSON, and back.

A provider has three methods (the protocol a custom component implements):

    tensors() -> dict[str, Tensor]      live tensors to snapshot (never copied here)
    meta() -> JSON-able                  small metadata, captured at the same moment
    load(tensors, meta) -> None          restore; ``tensors`` are read-only views into
                                         snapshot memory: copy, never keep them

An ``async_ok`` provider may return placeholders on the ``meta`` device from ``tensors()``
(shape and dtype, no data) and implement ``fill(destinations)``: the snapshot engine then calls
``meta()`` and ``fill({key: tensor})`` on its own thread, with the snapshot's memory to write
into (an offloaded optimizer reads its files there; nothing is read on the training thread).

``async_ok`` says whether the provider's tensors change only inside ``optimizer.step()``
(parameters, optimizer state): those are copied in the background while the next
forward/backward runs. Everything else (RNG, data position, buffers, JSON values) is
captured synchronously at the end of the step: it is small.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch


class StateProvider(Protocol):
    async_ok: bool

    def tensors(self) -> dict[str, torch.Tensor]: ...

    def meta(self) -> Any: ...

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None: ...


def materialized(p: Any) -> dict[str, torch.Tensor]:
    """``p.tensors()`` with data: placeholders on the ``meta`` device filled into new memory."""
    tensors = p.tensors()
    lazy = {k: t for k, t in tensors.items() if t.is_meta}
    if not lazy:
        return tensors
    p.meta()  # pins down what fill() reads
    real = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in lazy.items()}
    p.fill(real)
    return {**tensors, **real}


# -- FSDP2: DTensors are snapshotted and restored as their local shards -------------------
def is_dtensor(t: object) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor can exist
    return mod is not None and isinstance(t, mod.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a snapshot copies: a DTensor's local shard (same storage), else itself."""
    if is_dtensor(t):
        return t._local_tensor  # type: ignore[attr-defined]
    return t


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (a restored local shard) as a DTensor laid out like ``param``, if ``param``
    is one and ``value`` is its shard's shape (optimizer moments); else ``value``."""
    if not is_dtensor(param) or value.shape != local(param).shape:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, param.device_mesh, param.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=param.shape, stride=param.stride())


# -- generic nested state (state_dict() style) ---------------------------------------------
def split_state(obj: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Nested dict/list/tuple with tensors -> (flat tensors, JSON skeleton)."""
    tensors: dict[str, torch.Tensor] = {}

    def put(path: str, t: torch.Tensor) -> None:
        if path in tensors:  # cannot happen with escaped names; never overwrite silently
            raise ValueError(f"two tensors in the state map to the name {path!r}")
        tensors[path] = t

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            put(path, x.detach())
            return {"__tensor__": path}
        if isinstance(x, Mapping):
            keys = list(x.keys())
            if all(isinstance(k, str) for k in keys):
                return {"__dict__": {k: walk(v, f"{path}.{_name(k)}") for k, v in x.items()}}
            return {"__items__": [[_key(k), walk(v, f"{path}.{_name(_key(k))}")] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"__tuple__": [walk(v, f"{path}.{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(x)]
        if isinstance(x, np.ndarray):
            put(path, torch.from_numpy(np.ascontiguousarray(x)))
            return {"__ndarray__": path}
        if isinstance(x, np.generic):
            return x.item()
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(
            f"state at {path or '<root>'} has a {type(x).__name__}, which hotspare cannot "
            "snapshot: use tensors, numbers, strings, lists or dicts (or write a provider)"
        )

    return tensors, walk(obj, prefix)


def _name(k: Any) -> str:
    """A key as one unambiguous path segment: '.' and '~' escaped, non-strings tagged
    (so {"a.b": x} and {"a": {"b": y}}, or keys 1 and "1", never share a name)."""
    if isinstance(k, str):
        k = k.replace("~", "~0").replace(".", "~1")
        return "~2" + k[1:] if k.startswith("#") else k
    if isinstance(k, int) and not isinstance(k, bool):
        return f"#{k}"
    return f"#{type(k).__name__}:{k}"


def _unname(seg: str) -> str:
    s = "#" + seg[2:] if seg.startswith("~2") else seg
    return s.replace("~1", ".").replace("~0", "~")


def _key(k: Any) -> Any:
    if isinstance(k, (int, str, float, bool)) or k is None:
        return k
    raise TypeError(f"state dict key {k!r} ({type(k).__name__}) cannot be snapshotted")


def join_state(tensors: Mapping[str, torch.Tensor], skel: Any, clone: bool = True) -> Any:
    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if "__tensor__" in x:
                t = tensors[x["__tensor__"]]
                return t.clone() if clone else t
            if "__ndarray__" in x:
                return tensors[x["__ndarray__"]].numpy().copy()
            if "__dict__" in x:
                return {k: walk(v) for k, v in x["__dict__"].items()}
            if "__items__" in x:
                return {k: walk(v) for k, v in x["__items__"]}
            if "__tuple__" in x:
                return tuple(walk(v) for v in x["__tuple__"])
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(skel)


# -- providers ------------------------------------------------------------------------------
class ModuleState:
    """Parameters (async) and buffers (sync) of an ``nn.Module``, restored in place so the
    optimizer's references to the parameters stay valid."""

    def __init__(self, module: torch.nn.Module, params: bool) -> None:
        self.module = module
        self.params = params
        self.async_ok = params

    def _live(self) -> dict[str, torch.Tensor]:
        if self.params:
            key = tuple(id(p) for p in self.module.parameters())
            if key != getattr(self, "_key", None):  # FSDP2 parameters: their local shards
                self._key, self._cache = key, {k: local(p) for k, p in self.module.named_parameters()}
            return self._cache
        return {k: local(b) for k, b in self.module.named_buffers()}  # walked every time: a buffer may be replaced

    def tensors(self) -> dict[str, torch.Tensor]:
        return self._live()

    def meta(self) -> Any:
        return None

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
        live = self._live()
        missing = set(live) - set(tensors)
        if missing:
            raise KeyError(f"snapshot lacks {sorted(missing)[:5]} of the model")
        wrong = [f"{k}: {tuple(tensors[k].shape)} {tensors[k].dtype} for {tuple(t.shape)} {t.dtype}"
                 for k, t in live.items() if tensors[k].shape != t.shape or tensors[k].dtype != t.dtype]
        if wrong:  # copy_ would broadcast and cast without a word: never restore another model
            raise ValueError(f"the snapshot is of another model: {len(wrong)} tensor(s) differ in shape or dtype, "
                             f"e.g. {'; '.join(wrong[:3])}")
        with torch.no_grad():
            for k, t in live.items():
                t.copy_(tensors[k])


class StatefulState:
    """Anything with ``state_dict()``/``load_state_dict()``: optimizers, schedulers, data
    loaders (the torchdata ``StatefulDataLoader`` convention)."""

    def __init__(self, obj: Any, async_ok: bool = False) -> None:
        self.obj = obj
        self.async_ok = async_ok
        self._skel: Any = None

    def tensors(self) -> dict[str, torch.Tensor]:
        tensors, self._skel = split_state(self.obj.state_dict())
        return tensors

    def meta(self) -> Any:
        if self._skel is None:
            self.tensors()
        return self._skel

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
        # clone: an optimizer may keep the tensors it is given, and these are views into
        # snapshot memory that the next snapshot overwrites
        self.obj.load_state_dict(join_state(tensors, meta, clone=True))


class OptimizerState:
    """A ``torch.optim.Optimizer``'s per-parameter state (tensors, async) and param groups
    (JSON). Walks ``optimizer.state`` directly instead of ``state_dict()``: this runs every
    step, and ``state_dict()`` rebuilds and deep-copies far more than a snapshot needs."""

    async_ok = True

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.opt.param_groups for p in g["params"]]

    def tensors(self) -> dict[str, torch.Tensor]:
        # the same tensor objects are updated in place step after step: rebuild the name
        # map only when the set of state tensors changed
        key = tuple(id(v) for st in self.opt.state.values() for v in st.values())
        if key == getattr(self, "_key", None):
            return self._cache
        out: dict[str, torch.Tensor] = {}
        self._sharded: list[str] = []  # names whose state is a DTensor (FSDP2): its local shard is kept
        for i, p in enumerate(self._params()):
            st = self.opt.state.get(p)
            if st:
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        out[f"state.#{i}.{_name(k)}"] = local(v)
                        if is_dtensor(v):
                            self._sharded.append(f"state.#{i}.{_name(k)}")
        self._key, self._cache = key, out
        return out

    def meta(self) -> Any:
        groups = [{k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])}
                  for g in self.opt.param_groups]
        scalars = {}
        for i, p in enumerate(self._params()):
            st = self.opt.state.get(p)
            if st:
                scalars[str(i)] = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
        if getattr(self, "_key", None) is None:
            self.tensors()
        return split_state({"groups": groups, "scalars": scalars, "sharded": self._sharded})[1]

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
        m = join_state({}, meta)
        params = self._params()
        sharded = set(m.get("sharded", ()))
        state: dict[int, dict] = {}
        for name, t in tensors.items():
            _, idx, key = name.split(".", 2)
            i = int(idx[1:])
            state.setdefault(i, {})[_unname(key)] = like(t.clone(), params[i]) if name in sharded else t.clone()
        for idx, sc in m["scalars"].items():
            state.setdefault(int(idx), {}).update(sc)
        groups, start = [], 0
        for g in m["groups"]:
            n = g.pop("n")
            groups.append({**g, "params": list(range(start, start + n))})
            start += n
        self.opt.load_state_dict({"state": state, "param_groups": groups})


class RNGState:
    """torch (CPU and CUDA), numpy and Python ``random`` generator states.

    Every session tracks these (``rng``): the *global* generators -- ``torch``'s default
    CPU generator and each initialised CUDA device's, ``numpy.random``'s legacy global
    ``RandomState`` (``np.random.rand``, ``np.random.seed``), and the ``random`` module's
    global instance. Generators a script creates itself (``torch.Generator()``,
    ``np.random.default_rng()``, ``random.Random()``) are not: track them with a provider.
    Seeding is the script's job, as with torchrun: hotspare restores states, it never seeds,
    and an unseeded generator starts from a different state in every process."""

    async_ok = False

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                out[f"cuda{i}"] = s
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = torch.from_numpy(keys.astype(np.uint32).view(np.int32).copy())
        self._np = [name, int(pos), int(has_gauss), float(cached)]
        version, state, gauss = random.getstate()
        out["python"] = torch.from_numpy(np.fromiter(state, dtype=np.int64, count=len(state)))
        self._py = [version, gauss]
        return out

    def meta(self) -> Any:
        return {"numpy": self._np, "python": self._py}

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
        torch.set_rng_state(tensors["torch"].clone())
        cuda = [tensors[k].clone() for k in sorted((k for k in tensors if k.startswith("cuda")), key=lambda k: int(k[4:]))]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
        name, pos, has_gauss, cached = meta["numpy"]
        keys = tensors["numpy"].numpy().view(np.uint32).copy()
        np.random.set_state((name, keys, pos, has_gauss, cached))
        version, gauss = meta["python"]
        random.setstate((version, tuple(int(x) for x in tensors["python"].tolist()), gauss))


def reseed(seed: int) -> None:
    """Seed torch (every device), numpy and Python ``random`` from one integer."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


class ValueState:
    """JSON-able values in a dict the user keeps mutating (``extra=...``): restored in place."""

    async_ok = False

    def __init__(self, values: dict) -> None:
        if not isinstance(values, dict):
            raise TypeError("extra= takes a dict of JSON-able values (restored in place)")
        self.values = values

    def tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def meta(self) -> Any:
        tensors, skel = split_state(self.values)
        if tensors:
            raise TypeError(
                f"extra= holds JSON values only, but {sorted(tensors)[0]!r} is an array or "
                "tensor: track it with a provider (an object with state_dict/load_state_dict)"
            )
        return skel

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
        restored = join_state({}, meta)
        self.values.clear()
        self.values.update(restored)


def provider_for(name: str, obj: Any) -> list[tuple[str, Any]]:
    """The provider(s) hotspare uses for a tracked object, keyed by component name."""
    if hasattr(obj, "tensors") and hasattr(obj, "load") and hasattr(obj, "meta"):
        return [(name, obj)]  # a custom provider
    if isinstance(obj, torch.nn.Module):
        return [(f"{name}.params", ModuleState(obj, True)), (f"{name}.buffers", ModuleState(obj, False))]
    if isinstance(obj, torch.optim.Optimizer):
        return [(name, OptimizerState(obj))]
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
        return [(name, StatefulState(obj))]
    if isinstance(obj, dict):
        return [(name, ValueState(obj))]
    raise TypeError(
        f"track({name}=...): a {type(obj).__name__} has no state_dict()/load_state_dict(); "
        "pass an nn.Module, an optimizer, an object with state_dict/load_state_dict, a dict "
        "of JSON values, or a custom provider (tensors/meta/load)"
    )
