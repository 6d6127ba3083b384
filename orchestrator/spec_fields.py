"""How each field of a job spec is checked: the validators behind ``spec.parse_spec``.

Part of :mod:`hotspare.orchestrator.spec` (use that module's API; these functions are its parts). Every
check raises :class:`SpecError` naming the field, the bad value and the fix; the messages are
the user interface, and tests/unit/test_spec.py pins many of them. Standard library only.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .spec_model import BACKEND_OPTIONS, EtcdConfig, SpecError, yaml_shape

# DNS-label rules: the name ends up in etcd keys, k8s object names and Slurm job names, and this is
# the strictest of those.
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")  # \Z: "$" would let a trailing newline through
_EXAMPLE_ENDPOINT = "http://127.0.0.1:2379"


class _Missing:
    """Sentinel type so that ``None`` can be told apart from "key absent"."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()

_ETCD_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EtcdConfig))


# ---- generic helpers ------------------------------------------------------------------------


def _join(prefix: str | None, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for a close match, else ``''``; typos are the usual culprit."""
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


def check_keys(data: Mapping[Any, Any], allowed: tuple[str, ...], where: str | None) -> None:
    """Unknown keys are errors, not warnings: a misspelt optional key would otherwise be ignored
    and the job would silently run with the default."""
    for key in data:
        if not isinstance(key, str):
            raise SpecError(f"field names must be strings, got {key!r}", field=where)
        if key not in allowed:
            hint = _did_you_mean(key, allowed) or f" (allowed: {', '.join(allowed)})"
            raise SpecError(f"unknown field {key!r}{hint}", field=where)


def check_required(
    data: Mapping[str, Any], required: Mapping[str, str], where: str | None
) -> None:
    for key, example in required.items():
        if data.get(key) is None:
            raise SpecError(f"required (e.g. {key}: {example})", field=_join(where, key))


def _none_hint(value: Any, default: Any) -> str:
    """Extra hint for the two most common type slips: an empty YAML value and a quoted number."""
    if value is None and default is not _MISSING:
        return f" (remove the line to use the default, {default})"
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return " (write the number without quotes)"
    return ""


#: sane upper bounds (security review F18: `ranks: 1e30` made the local backend build a list of
#: 10^30 nodes; a TTL of 1e300 overflowed gRPC's int64): counts of processes, anything else
#: (steps, retries; JSON's exact integers), and durations
MAX_PROCESSES = 65536
MAX_INT = 2**53 - 1
MAX_SECONDS = 30 * 86400.0


def parse_int(field_path: str, value: Any, *, minimum: int, default: Any = _MISSING, maximum: int = MAX_INT) -> int:
    # bool is an int subclass; `ranks: yes` must not quietly mean 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(
            f"must be an integer, got {value!r}{_none_hint(value, default)}", field=field_path
        )
    if value < minimum:
        raise SpecError(f"must be >= {minimum}, got {value}", field=field_path)
    if value > maximum:
        raise SpecError(f"must be <= {maximum}, got {value}", field=field_path)
    return value


def parse_ratio(field_path: str, value: Any) -> float:
    """A slowdown factor (> 1): how many times the median compute time makes a straggler."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"must be a number like 2.0 (times the median step compute time), got {value!r}",
                        field=field_path)
    if value <= 1:
        raise SpecError(f"must be > 1 (1 would flag every rank), got {value!r}", field=field_path)
    return float(value)


def parse_seconds(
    field_path: str,
    value: Any,
    *,
    minimum: float | None = None,
    above: float | None = None,
    default: Any = _MISSING,
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(
            f"must be a number of seconds, got {value!r}{_none_hint(value, default)}",
            field=field_path,
        )
    seconds = float(value)
    if not math.isfinite(seconds):
        raise SpecError(f"must be a finite number of seconds, got {value!r}", field=field_path)
    if minimum is not None and seconds < minimum:
        raise SpecError(f"must be >= {minimum:g} seconds, got {value!r}", field=field_path)
    if above is not None and seconds <= above:
        raise SpecError(f"must be > {above:g} seconds, got {value!r}", field=field_path)
    if seconds > MAX_SECONDS:
        raise SpecError(f"must be <= {MAX_SECONDS:g} seconds (30 days), got {value!r}", field=field_path)
    return seconds


_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)
_SIZE_SCALE = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(field_path: str, value: Any) -> int | None:
    """A number of bytes: an integer, or a string like ``8GiB``/``8Gi`` (binary: 8 x 2^30) or
    ``8GB``/``8G`` (decimal: 8 x 10^9), as Kubernetes writes sizes; None stays None."""
    if value is None:
        return None
    m = _SIZE_RE.fullmatch(value) if isinstance(value, str) else None
    if m and m.group(3) and not m.group(2):  # "8i": binary of what?
        m = None
    if isinstance(value, bool) or not (isinstance(value, int) or m):
        raise SpecError(f"must be a size like 8GiB, 512MiB or 16GB (or a number of bytes), got {value!r}",
                        field=field_path)
    if m:
        number, prefix, binary, _ = m.groups()
        n = int(float(number) * ((1024 if binary else 1000) ** _SIZE_SCALE[prefix.lower()]))
    else:
        n = value
    if n < 1 or n > MAX_INT:
        raise SpecError(f"must be between 1 byte and {MAX_INT} bytes, got {value!r}", field=field_path)
    return n


def parse_choice(
    field_path: str, value: Any, choices: tuple[str, ...], *, default: Any = _MISSING
) -> str:
    if not isinstance(value, str) or value not in choices:
        hint = _did_you_mean(value, choices) if isinstance(value, str) else ""
        if not hint:
            hint = _none_hint(value, default) if value is None else ""
        raise SpecError(
            f"must be one of {', '.join(choices)}, got {value!r}{hint}", field=field_path
        )
    return value


def resolve_path(path: str, base_dir: str) -> str:
    return os.path.abspath(os.path.join(base_dir, os.path.expanduser(path)))


# ---- per-field parsers ----------------------------------------------------------------------


def _suggest_name(name: str) -> str:
    fixed = re.sub(r"[^a-z0-9-]", "-", name.lower())
    fixed = re.sub(r"-{2,}", "-", fixed).strip("-")[:63].strip("-")
    return fixed or "my-job"


def parse_name(value: Any) -> str:
    if not isinstance(value, str):
        raise SpecError(f"must be a string, got {value!r} (e.g. name: my-job)", field="name")
    if not _NAME_RE.match(value):
        raise SpecError(
            f"must be 1-63 lowercase letters, digits or '-', starting and ending with a letter "
            f"or digit, got {value!r} (try {_suggest_name(value)!r})",
            field="name",
        )
    return value


def parse_entrypoint(value: Any, base_dir: str) -> str:
    """``module.path:function`` or ``file.py:function``; a file is made absolute and must exist.

    The module form is deliberately *not* imported here: importing user code would pull in torch
    and run arbitrary side effects in the controller. Workers import it when they start.
    """
    forms = "'module.path:function' or 'path/to/file.py:function'"
    if not isinstance(value, str):
        raise SpecError(f"must be {forms}, got {value!r}", field="entrypoint")
    text = value.strip()
    target, sep, func = text.rpartition(":")
    if not sep or not target:
        example = f"{text}:train" if text else "train.py:train"
        raise SpecError(
            f"must be {forms}, got {value!r} (add the function to call, e.g. {example!r})",
            field="entrypoint",
        )
    if not func.isidentifier() or keyword.iskeyword(func):
        raise SpecError(
            f"function {func!r} in {value!r} is not a Python identifier "
            f"(name the train function, e.g. '{target}:train')",
            field="entrypoint",
        )
    if target.endswith(".py"):
        path = resolve_path(target, base_dir)
        if not os.path.isfile(path):
            raise SpecError(
                f"file not found: {path} (from {value!r}; relative paths are resolved against "
                f"the spec file's directory {base_dir})",
                field="entrypoint",
            )
        return f"{path}:{func}"
    parts = target.split(".")
    if not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise SpecError(
            f"{target!r} in {value!r} is neither a .py file nor a dotted module path (use {forms})",
            field="entrypoint",
        )
    return f"{target}:{func}"


def _plain_data(value: Any, path: str) -> Any:
    """Copy ``value`` checking it is JSON data: args travel to workers as JSON and must come back
    equal, so dates, sets, NaN or non-string keys are refused here rather than mangled later."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SpecError(
                f"must be a finite number, got {value!r} (pass it as a string, e.g. 'inf')",
                field=path,
            )
        return value
    if isinstance(value, (list, tuple)):
        return [_plain_data(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise SpecError(f"mapping keys must be strings, got {k!r} (quote it)", field=path)
            out[k] = _plain_data(v, f"{path}.{k}")
        return out
    raise SpecError(
        f"must be plain data (string, number, bool, null, list or mapping), got {value!r} "
        f"(quote it to pass a string)",
        field=path,
    )


def parse_args(value: Any) -> dict[str, Any]:
    """Keyword arguments for the train function, so keys must be valid Python identifiers."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(
            f"must be a mapping of keyword arguments, got {yaml_shape(value)} "
            f"(e.g. args: {{lr: 0.001}})",
            field="args",
        )
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
            suggestion = re.sub(r"\W", "_", str(key))
            if not suggestion.isidentifier() or keyword.iskeyword(suggestion):
                suggestion = f"arg_{suggestion}"
            raise SpecError(
                f"key {key!r} is not a valid Python keyword argument name (try {suggestion!r})",
                field="args",
            )
        out[key] = _plain_data(item, f"args.{key}")
    return out


def _normalise_endpoint(raw: Any, where: str) -> str:
    """``host:port`` / ``http(s)://host:port`` -> ``http(s)://host:port``, so the etcd client and
    the health checks see one canonical spelling."""
    fix = f"expected host:port or http(s)://host:port, e.g. {_EXAMPLE_ENDPOINT}"
    if not isinstance(raw, str):
        raise SpecError(f"bad endpoint {raw!r} ({fix})", field=where)
    text = raw.strip()
    scheme = "http"
    rest = text
    if "://" in text:
        scheme, _, rest = text.partition("://")
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise SpecError(
                f"bad endpoint {raw!r}: scheme must be http or https ({fix})", field=where
            )
    rest = rest.rstrip("/")
    if rest.startswith("["):  # IPv6 literal: [::1]:2379
        close = rest.find("]")
        host = rest[: close + 1] if close > 0 else ""
        after = rest[close + 1 :] if close > 0 else ""
        port_text = after[1:] if after.startswith(":") else ""
    else:
        host, _, port_text = rest.rpartition(":")
    bad_host = not host or bool(re.search(r"[\s/@]", host))
    if not host.startswith("[") and ":" in host:  # unbracketed IPv6 or a stray colon
        bad_host = True
    if bad_host or not port_text:
        raise SpecError(f"bad endpoint {raw!r}: needs a host and a port ({fix})", field=where)
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise SpecError(
            f"bad endpoint {raw!r}: port {port_text!r} must be an integer 1-65535 ({fix})",
            field=where,
        )
    return f"{scheme}://{host}:{int(port_text)}"


def _parse_endpoints(value: Any, where: str) -> tuple[str, ...]:
    if value is None or value == "embedded":
        return ()
    if isinstance(value, str):
        # Comma-separated lists are the etcdctl convention (ETCDCTL_ENDPOINTS).
        items = [p for p in (s.strip() for s in value.split(",")) if p]
        if len(items) == 1:
            return (_normalise_endpoint(items[0], where),)
        return tuple(_normalise_endpoint(p, f"{where}[{i}]") for i, p in enumerate(items))
    if isinstance(value, (list, tuple)):
        return tuple(_normalise_endpoint(p, f"{where}[{i}]") for i, p in enumerate(value))
    raise SpecError(
        f"must be 'embedded', an endpoint string or a list of endpoints, got {value!r} "
        f"(e.g. {_EXAMPLE_ENDPOINT})",
        field=where,
    )


def parse_etcd(value: Any, base_dir: str) -> EtcdConfig:
    if value is None or isinstance(value, (str, list, tuple)):
        return EtcdConfig(endpoints=_parse_endpoints(value, "etcd"))
    if not isinstance(value, Mapping):
        raise SpecError(
            f"must be 'embedded', an endpoint string, a list of endpoints or a mapping with "
            f"endpoints, got {value!r} (e.g. etcd: {_EXAMPLE_ENDPOINT})",
            field="etcd",
        )
    check_keys(value, _ETCD_FIELDS, where="etcd")
    endpoints = _parse_endpoints(value.get("endpoints"), "etcd.endpoints")
    extras: dict[str, str | None] = {}
    for key in ("ca_cert", "cert", "key", "user", "password"):
        item = value.get(key)
        if item is not None and (not isinstance(item, str) or not item):
            quote = " (quote it)" if key in ("user", "password") else ""
            raise SpecError(f"must be a non-empty string, got {item!r}{quote}", field=f"etcd.{key}")
        if item is not None and key in ("ca_cert", "cert", "key"):
            item = resolve_path(item, base_dir)
        extras[key] = item
    given = [k for k, v in extras.items() if v is not None]
    if given and not endpoints:
        raise SpecError(
            f"{given[0]} only applies to an external etcd; add endpoints "
            f"(e.g. endpoints: https://etcd-0:2379) or remove {given[0]}",
            field="etcd",
        )
    if (extras["cert"] is None) != (extras["key"] is None):
        have, need = ("cert", "key") if extras["cert"] is not None else ("key", "cert")
        raise SpecError(f"{have} is set but {need} is not (client TLS needs both)", field="etcd")
    if (extras["user"] is None) != (extras["password"] is None):
        have, need = ("user", "password") if extras["user"] is not None else ("password", "user")
        raise SpecError(f"{have} is set but {need} is not (etcd auth needs both)", field="etcd")
    return EtcdConfig(endpoints=endpoints, **extras)


def parse_output_dir(value: Any, base_dir: str, name: str = "output_dir") -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise SpecError(
            f"must be a directory path, got {value!r} (e.g. {name}: runs/my-job)",
            field=name,
        )
    _one_line(value, name)
    return resolve_path(value, base_dir)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _one_line(value: str, field: str) -> str:
    """Refuse control characters (a newline above all): such a value, written into a Slurm
    batch script or a command line, becomes a line of its own (security review F12)."""
    m = _CONTROL.search(value)
    if m:
        raise SpecError(f"must not contain control characters such as newlines, got {value!r} "
                        f"(character {m.group()!r} at position {m.start()})", field=field)
    return value


def parse_persist_path(value: Any, base_dir: str) -> str | None:
    """A directory, or an fsspec URL (s3://bucket/prefix, gs://..., file:///...)."""
    if isinstance(value, str) and re.match(r"^[a-z][a-z0-9+.-]*://", value):
        return value
    return parse_output_dir(value, base_dir, "persist_path")


def parse_env(value: Any) -> dict[str, str]:
    """Extra worker environment. YAML turns ``1`` and ``true`` into int/bool; environment values
    are strings, so scalars are coerced (bools to ``true``/``false``, as most tools expect)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(
            f"must be a mapping of NAME: value, got {yaml_shape(value)} "
            f"(e.g. env: {{NCCL_DEBUG: WARN}})",
            field="env",
        )
    out: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise SpecError(
                f"variable names must be non-empty strings without '=', got {key!r}", field="env"
            )
        if isinstance(item, bool):
            out[key] = "true" if item else "false"
        elif isinstance(item, str) and "\0" in item:  # Popen would raise in every agent at spawn
            raise SpecError(f"must not contain a NUL character, got {item!r}", field=f"env.{key}")
        elif isinstance(item, (str, int, float)):
            out[key] = str(item)
        else:
            raise SpecError(
                f"must be a string, got {item!r} (quote it, e.g. {key}: '')", field=f"env.{key}"
            )
    return out


def parse_backend_options(backend: str, value: Any) -> dict[str, Any]:
    schema = BACKEND_OPTIONS[backend]
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        first = next(iter(schema))
        raise SpecError(
            f"must be a mapping of option: value, got {yaml_shape(value)} "
            f"(e.g. {backend}: {{{first}: ...}}; options: {', '.join(schema)})",
            field=backend,
        )
    check_keys(value, tuple(schema), where=backend)
    out: dict[str, Any] = {}
    for key, item in value.items():
        kind, help_ = schema[key]
        where = f"{backend}.{key}"
        if kind == "str" and isinstance(item, str) and item.strip():
            out[key] = item if key == "setup" else _one_line(item, where)  # setup: shell lines, on purpose
        elif kind == "int" and isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            out[key] = item
        elif kind == "float" and isinstance(item, (int, float)) and not isinstance(item, bool) \
                and math.isfinite(item) and item >= 0:
            out[key] = float(item)
        elif kind == "strlist" and isinstance(item, (list, tuple)) \
                and all(isinstance(x, str) and x for x in item):
            out[key] = [_one_line(x, where) for x in item]
        elif kind in ("strmap", "strfloat") and isinstance(item, Mapping) and all(
            isinstance(k, str) and k and (
                isinstance(v, str) if kind == "strmap"
                else isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0)
            for k, v in item.items()
        ):
            out[key] = {k: (v if kind == "strmap" else float(v)) for k, v in item.items()}
        else:
            want = {"str": "a non-empty string", "int": "a whole number >= 0",
                    "float": "a number >= 0", "strlist": "a list of non-empty strings",
                    "strmap": "a mapping of string to string",
                    "strfloat": "a mapping of name to a number >= 0"}[kind]
            raise SpecError(f"must be {want}, got {item!r} ({help_})", field=where)
    return out
