"""Reading back, restoring and snapshotting :class:`~hotspare.recovery.offload.OffloadedAdamW`'s
offloaded state (a mixin of the optimizer; its methods run on the training thread).

* ``state_files()`` -- for the last completed step: per layer, the file and version (``a``/``b``)
  that hold it (``None``: the layer has no state yet, its moments are zero). Valid until the
  optimizer completes the *next* step and starts writing the one after (a layer's write only
  ever goes to the version not holding its state at the last completed step). The same dict is
  ``manifest.json`` in the directory.
* ``load_from(files_or_directory)`` -- restore from such a dict (files of this optimizer are
  adopted in place, others are copied, every one checked against its CRCs) or a directory with
  a ``manifest.json``.
* ``read_state()`` / ``state_dict()`` / ``load_state_dict()`` -- per-parameter tensors, torch's
  optimizer format (``AdamW.state_dict()`` loads into this optimizer and back).
* ``tensors()`` / ``meta()`` / ``fill()`` / ``load()`` / ``async_ok`` -- hotspare's state-provider
  protocol (:mod:`hotspare.recovery.state`): ``tensors()`` returns placeholders on the ``meta``
  device (names ``<param name>:<key>``; nothing is read on the training thread); on the snapshot
  engine's thread ``meta()`` waits for pending updates and pins the file versions, and ``fill()``
  reads them, layer by layer, straight into the snapshot's memory.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .offload_io import Buffer, Layer, OffloadError, S, pack_header

FORMAT = "hotspare-offload/1"
EXTRA = ("initial_lr",)  # LR schedulers' own group keys, restored with the hyper-parameters


class OffloadStateMixin:
    # -- where the last completed step is ---------------------------------------------------------
    def state_files(self) -> dict[str, Any]:
        """The files holding the last completed step (see the module docstring)."""
        with self._cv:  # type: ignore[attr-defined]
            done = self._done  # type: ignore[attr-defined]
            out = []
            for L in self.layers:  # type: ignore[attr-defined]
                v = L.cur
                if v >= 0 and L.gens[v] > done:  # already written for the step in progress
                    v = 1 - v if L.crcs[1 - v] is not None else -1
                out.append({"index": L.index, "name": L.name, "path": L.paths[v] if v >= 0 else None,
                            "version": "ab"[v] if v >= 0 else None, "gen": L.gens[v] if v >= 0 else 0,
                            "bytes": L.total, "numels": [p.numel() for p in L.params], "params": L.names})
            return {"format": FORMAT, "step": done, "root": str(self.root),  # type: ignore[attr-defined]
                    "keys": list(self.keys), "layers": out}  # type: ignore[attr-defined]

    # -- reading -------------------------------------------------------------------------------
    def _read_layer(self, L: Layer, path: str, expect_gen: int | None = None) -> tuple[Buffer, dict[str, Any]]:
        """A layer file's header and contents (checked: layout, CRCs) in a new buffer."""
        io = self.io  # type: ignore[attr-defined]
        own = path in L.paths and L.fds[L.paths.index(path)] is not None
        fd = L.fds[L.paths.index(path)] if own else io.open(path, create=False)
        try:
            head = io.read_header(fd)
            if (head.get("data_len"), head.get("header_len"), head.get("numels"), head.get("keys")) != (
                    L.data_len, L.header_len, [p.numel() for p in L.params], list(L.keys)):
                raise OffloadError(f"{path} holds the state of another layer layout (layer {head.get('layer')}, "
                                   f"{head.get('name')!r}) than layer {L.index} ({L.name}): wrong model or files")
            if expect_gen is not None and head.get("gen") != expect_gen:
                raise OffloadError(f"{path} holds step {head.get('gen')}, the manifest says {expect_gen}: the "
                                   "files were changed after the manifest was written")
            buf = Buffer(L.total)
            io._sync(io.read(fd, buf, L.header_len, L.total, head.get("crcs"), algo=head.get("sum") or "crc32"))
            return buf, head
        finally:
            if not own:
                io.close(fd)

    def read_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Every stepped parameter's state (``step``, moments) as new tensors, like
        ``torch.optim.AdamW().state[p]``: finishes pending updates first. Holds the whole state
        in RAM: for tests, exports and snapshots, not for the training loop."""
        self.finish()  # type: ignore[attr-defined]
        out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for L in self.layers:  # type: ignore[attr-defined]
            if L.cur < 0:
                continue
            buf, _ = self._read_layer(L, L.paths[L.cur])
            views = L.views(buf)
            for i, p in enumerate(L.params):
                if float(L.steps[i]) > 0:
                    out[p] = {"step": L.steps[i].clone(), **{k: views[k][i].clone() for k in L.keys}}
        return out

    # -- writing a whole state (restore) --------------------------------------------------------------
    def _write_sync(self, L: Layer, buf: Buffer, steps: list[float], gen: int) -> None:
        io = self.io  # type: ignore[attr-defined]
        v = 0 if L.cur < 0 else 1 - L.cur
        L.error_path = L.paths[v]
        try:
            fd = self._fd(L, v)  # type: ignore[attr-defined]
            b = io._sync(io.write(fd, buf, L.header_len, L.total))
            meta = L.header_meta(gen, io, b.crcs, steps)
            buf.view[:L.header_len] = pack_header(meta, L.header_len)
            io._sync(io.write(fd, buf, 0, L.header_len))
        except OSError as e:
            raise OffloadError(f"could not write the optimizer state of layer {L.index} ({L.name}) to "
                               f"{L.paths[v]}: {e}; the other version is untouched") from e
        L.cur, L.crcs[v], L.gens[v] = v, b.crcs, gen
        for i, s in enumerate(steps):
            L.steps[i].fill_(s)

    def _pause(self) -> None:
        """Finish pending updates and stop speculative reads (they would read replaced files)."""
        self.finish()  # type: ignore[attr-defined]
        with self._cv:  # type: ignore[attr-defined]
            self._paused = True
            # and the updates of an iteration step() never closed (a failed step rolled back): a
            # layer still computing or writing would land on the files this restore writes
            while any(L.state in (S.LOADING, S.COMPUTING, S.WRITING) for L in self.layers):  # type: ignore[attr-defined]
                self._cv.wait()  # type: ignore[attr-defined]
            for L in self.layers:  # type: ignore[attr-defined]
                self._release(L)  # type: ignore[attr-defined]

    def _restored(self, step: int) -> None:
        with self._cv:  # type: ignore[attr-defined]
            self._it = self._done = int(step)  # type: ignore[attr-defined]
            self._started = -1  # the next update calls on_update_start again
            self._seen = []
            self._queue.clear()  # type: ignore[attr-defined]
            self._left.clear()  # type: ignore[attr-defined]
            self._counts.clear()  # type: ignore[attr-defined]
            for L in self.layers:  # type: ignore[attr-defined]
                L.pending, L.queued_it, L.grads = None, -1, {}
            self._write_manifest()  # type: ignore[attr-defined]
            self._paused = False
            self._cv.notify_all()  # type: ignore[attr-defined]

    def load_from(self, source: Mapping[str, Any] | str | os.PathLike) -> None:
        """Restore the state ``state_files()`` described (a dict, or a directory holding a
        ``manifest.json``); raises :class:`OffloadError` naming a missing or corrupt file."""
        if not isinstance(source, Mapping):
            mf = Path(source) / "manifest.json"
            try:
                source = json.loads(mf.read_text())
            except (OSError, ValueError) as e:
                raise OffloadError(f"cannot restore from {mf}: {e}") from None
        if source.get("format") != FORMAT:
            raise OffloadError(f"not an offloaded optimizer state (format {source.get('format')!r})")
        entries = {e["index"]: e for e in source["layers"]}
        if sorted(entries) != [L.index for L in self.layers]:  # type: ignore[attr-defined]
            raise OffloadError(f"the state has {len(entries)} layers, this optimizer "
                               f"{len(self.layers)}: another model or layers= split")  # type: ignore[attr-defined]
        self._pause()
        try:  # check every file before changing anything: a bad one leaves the optimizer as it was
            for L in self.layers:  # type: ignore[attr-defined]
                e = entries[L.index]
                if e["path"] is not None:
                    if not os.path.exists(e["path"]):
                        raise OffloadError(f"cannot restore layer {L.index} ({L.name}): {e['path']} is missing")
                    self._read_layer(L, e["path"], e["gen"])
        except BaseException:
            with self._cv:  # type: ignore[attr-defined]
                self._paused = False
                self._cv.notify_all()  # type: ignore[attr-defined]
            raise
        try:
            for L in self.layers:  # type: ignore[attr-defined]
                self._adopt(L, entries[L.index])
        except BaseException as e:  # half restored: never train on from here
            with self._cv:  # type: ignore[attr-defined]
                self._set_error(e if isinstance(e, OffloadError) else OffloadError(  # type: ignore[attr-defined]
                    f"restoring the optimizer state failed half-way ({e}); make a new optimizer"))
            raise
        self._restored(source["step"])

    def _adopt(self, L: Layer, e: Mapping[str, Any]) -> None:
        if e["path"] is None:
            L.cur = -1
            for s in L.steps:
                s.zero_()
        elif e["path"] in L.paths and self._same_sum(L, L.paths.index(e["path"])):  # ours: adopted as it is
            v = L.paths.index(e["path"])
            head = self.io.read_header(L.fds[v])  # type: ignore[attr-defined]
            L.cur, L.crcs[v], L.gens[v] = v, head.get("crcs"), head["gen"]
            L.crcs[1 - v] = None  # the other version is unknown: never listed again
            for i, st in enumerate(head["steps"]):
                L.steps[i].fill_(st)
        else:
            buf, head = self._read_layer(L, e["path"], e["gen"])
            self._write_sync(L, buf, head["steps"], head["gen"])

    def _same_sum(self, L: Layer, v: int) -> bool:
        """Whether our file ``v`` of ``L`` is checked the way this optimizer checks what it reads
        (a file of an older version, checked with another sum, is rewritten instead)."""
        self._fd(L, v)  # type: ignore[attr-defined]
        head = self.io.read_header(L.fds[v])  # type: ignore[attr-defined]
        return not self.io.verify or (head.get("sum") or "crc32") == self.io.sum  # type: ignore[attr-defined]

    def _install(self, state: Mapping[int, Mapping[str, torch.Tensor]], step: int) -> None:
        """Write per-parameter state (keyed by ``id(param)``) into every layer's files."""
        self._pause()
        for L in self.layers:  # type: ignore[attr-defined]
            buf = Buffer(L.total)
            buf.zero(L.header_len, L.total)
            views = L.views(buf)
            steps = []
            for i, p in enumerate(L.params):
                st = state.get(id(p), {})
                steps.append(float(st["step"]) if "step" in st else 0.0)
                for k in L.keys:
                    if k in st:
                        if tuple(st[k].shape) != tuple(p.shape):
                            raise ValueError(f"{L.names[i]}.{k}: shape {tuple(st[k].shape)}, the parameter "
                                             f"is {tuple(p.shape)}")
                        views[k][i].copy_(st[k])
            self._write_sync(L, buf, steps, step)
        self._restored(step)

    # -- torch format -----------------------------------------------------------------------------
    def _flat_params(self) -> list[nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]

    def _groups_meta(self) -> list[dict[str, Any]]:
        from .offload import HYPER

        return [{k: (list(g[k]) if k == "betas" else g[k]) for k in (*HYPER, *EXTRA) if k in g}
                for g in self.param_groups]  # type: ignore[attr-defined]

    def _set_groups(self, groups: list[Mapping[str, Any]]) -> None:
        if len(groups) != len(self.param_groups):  # type: ignore[attr-defined]
            raise ValueError(f"{len(groups)} parameter groups in the state, {len(self.param_groups)} here")  # type: ignore[attr-defined]
        for g, s in zip(self.param_groups, groups, strict=True):  # type: ignore[attr-defined]
            for k, v in s.items():
                if k != "params":
                    g[k] = tuple(v) if k == "betas" else v

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        st = self.read_state()
        index = {id(p): i for i, p in enumerate(self._flat_params())}
        groups, start = [], 0
        for g, meta in zip(self.param_groups, self._groups_meta(), strict=True):  # type: ignore[attr-defined]
            groups.append({**meta, "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": {index[id(p)]: s for p, s in st.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        params = self._flat_params()
        self._set_groups(state_dict["param_groups"])
        state = {id(params[int(i)]): s for i, s in state_dict["state"].items()}
        step = max((int(s["step"]) for s in state_dict["state"].values()), default=0)
        self._install(state, step)

    # -- hotspare state provider ------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Placeholders on the ``meta`` device: the names, shapes and dtypes of the state a
        snapshot holds (every parameter's ``step`` and moments; zeros for one never stepped).
        No data is read here, on the training thread: the snapshot engine asks :meth:`fill`
        for the bytes on its own thread, after :meth:`meta`."""
        if getattr(self, "_placeholders", None) is None:
            out: dict[str, torch.Tensor] = {}
            for L in self.layers:  # type: ignore[attr-defined]
                for i, (p, n) in enumerate(zip(L.params, L.names, strict=True)):
                    out[f"{n}:step"] = torch.empty((), dtype=L.steps[i].dtype, device="meta")
                    for k in L.keys:
                        out[f"{n}:{k}"] = torch.empty(p.shape, dtype=p.dtype, device="meta")
            self._placeholders = out
        # the hyper-parameters now (an LR scheduler changes them on this thread after the next step)
        self._groups_at_capture = self._groups_meta()
        return self._placeholders

    def meta(self) -> Any:
        """Waits for the updates of every ``step()`` so far, then pins down which file version
        holds each layer (what :meth:`fill` reads). Runs on the snapshot engine's thread; the
        next iteration's first update waits for the snapshot (``on_update_start``), and the
        version read is the one an update writes only two iterations later."""
        self.finish()  # type: ignore[attr-defined]
        files = self.state_files()
        groups = getattr(self, "_groups_at_capture", None) or self._groups_meta()
        self._groups_at_capture = None
        self._snapshot_files = files
        return {"format": FORMAT, "step": files["step"], "groups": groups}

    def fill(self, dsts: Mapping[str, torch.Tensor]) -> None:
        """Write the state :meth:`meta` pinned down into ``dsts`` (the snapshot's own memory,
        named as :meth:`tensors`), one layer at a time through one layer-sized buffer: the
        only RAM it takes beyond the snapshot itself. Every file is checked against its CRCs."""
        files = self._snapshot_files
        entries = {e["index"]: e for e in files["layers"]}
        for L in self.layers:  # type: ignore[attr-defined]
            e = entries[L.index]
            if e["path"] is None:
                for n in L.names:
                    for k in ("step", *L.keys):
                        if f"{n}:{k}" in dsts:
                            dsts[f"{n}:{k}"].zero_()
                continue
            buf, head = self._read_layer(L, e["path"], e["gen"])
            views = L.views(buf)
            for i, n in enumerate(L.names):
                if f"{n}:step" in dsts:
                    dsts[f"{n}:step"].fill_(head["steps"][i])
                for k in L.keys:
                    if f"{n}:{k}" in dsts:
                        dsts[f"{n}:{k}"].copy_(views[k][i])
            del views, buf

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
        params = {n: p for L in self.layers for p, n in zip(L.params, L.names, strict=True)}  # type: ignore[attr-defined]
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            pname, key = name.rsplit(":", 1)
            if pname not in params:
                raise KeyError(f"the snapshot's optimizer state has {pname!r}, which this model lacks")
            state.setdefault(id(params[pname]), {})[key] = t
        self._set_groups(meta["groups"])
        self._install(state, int(meta["step"]))

    # -- failures --------------------------------------------------------------------------------
    def _write_manifest(self) -> None:
        tmp = self.root / "manifest.json.tmp"
        tmp.write_text(json.dumps(self.state_files()))
        os.replace(tmp, self.root / "manifest.json")

    def _fail(self, L: Layer, e: BaseException, doing: str) -> None:
        """Stop the optimizer with one OffloadError naming the file and what to do."""
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            what = (f"could not write the optimizer state of layer {L.index} ({L.name}) to {L.error_path}: "
                    "no space left on device (ENOSPC)")
        elif isinstance(e, OffloadError):
            what = f"{doing} the optimizer state of layer {L.index} ({L.name}): {e}"
        else:
            path = L.error_path if doing != "reading" else (L.paths[L.cur] if L.cur >= 0 else "")
            what = f"{doing} the optimizer state of layer {L.index} ({L.name}) {path}: {type(e).__name__}: {e}"
        if doing == "reading":
            tail = ("" if isinstance(e, OffloadError) else " Restore a new optimizer from a snapshot or checkpoint "
                    "(load_from() / load_state_dict()).")
        else:
            prev = (f"The previous version {L.paths[L.cur]} (step {L.gens[L.cur]}) is intact" if L.cur >= 0
                    else "The layer had no earlier state")
            tail = (f" {prev}, and the files under {self.root} hold the complete step {self._done} "  # type: ignore[attr-defined]
                    "(manifest.json): free space or fix the disk, then restore a new optimizer with "
                    f"load_from('{self.root}').")  # type: ignore[attr-defined]
        err = OffloadError(f"{what}.{tail}")
        err.__cause__ = e
        with self._cv:  # type: ignore[attr-defined]
            self._set_error(err)

    def _set_error(self, err: OffloadError) -> None:
        if self._error is None:  # type: ignore[has-type]
            self._error = err
        self._cv.notify_all()  # type: ignore[attr-defined]

