"""One config path: command-line flags generated from the frozen config dataclasses.

``add_engine_args`` adds one flag per ``EngineConfig`` field (``--page-size``) and per
``SpeculativeConfig`` field under its flat name (``config.SPECULATIVE_ARGS``: ``--ngram-capacity``);
``engine_kwargs`` turns the flags that were given into the flat keyword arguments of ``LLM`` /
``llm.build_engine_config``. A flag left out is absent from the kwargs, so the dataclass default
applies: defaults live in one place. ``generate``, ``serve`` and ``python -m benchmarks`` use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from ngrammar.config import SPECULATIVE_ARGS, EngineConfig, SpeculativeConfig

_ON_OFF = {"auto": None, "on": True, "off": False}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_field(group: argparse._ArgumentGroup, name: str, f: dataclasses.Field[Any], hint: Any) -> None:
    """One flag for one field; its destination is the flat kwarg ``name`` and its default None (unset)."""
    help_ = f.metadata.get("help")
    flag_name = _dest(name, f)
    choices = f.metadata.get("choices")
    if hint is bool:  # a switch away from the default
        flag = _flag(flag_name) if not f.default else _flag("no_" + flag_name)
        group.add_argument(
            flag, dest=flag_name, action="store_const", const=not f.default, default=None, help=help_
        )
    elif hint == bool | None:  # None: decided per device
        group.add_argument(_flag(flag_name), dest=flag_name, default=None, choices=list(_ON_OFF), help=help_)
    elif hint == tuple[str, ...]:  # one or more values
        group.add_argument(
            _flag(flag_name), dest=flag_name, nargs="+", default=None, metavar="VALUE", help=help_
        )
    else:
        kind = next((t for t in (int, float, str) if hint in (t, t | None)), None)
        if kind is None:
            raise TypeError(f"no command-line flag for {name}: {hint}")
        group.add_argument(
            _flag(flag_name), dest=flag_name, type=kind, default=None, choices=choices, help=help_
        )


def _dest(name: str, f: dataclasses.Field[Any]) -> str:
    """The flag's name and destination: the flat kwarg's, unless the field names another one."""
    return f.metadata.get("flag") or name


def _fields() -> list[tuple[str, dataclasses.Field[Any], Any]]:
    """(flat kwarg name, field, type hint) of every config field that has a flag."""
    out = []
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name != "speculative":
            out.append((f.name, f, hints[f.name]))
    hints = typing.get_type_hints(SpeculativeConfig)
    by_field = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}
    for flat, name in SPECULATIVE_ARGS.items():
        out.append((flat, by_field[name], hints[name]))
    return out


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    spec = parser.add_argument_group("speculation")
    spec.add_argument("--speculative", default=None, choices=["ngram"], help="n-gram tree speculation")
    for name, f, hint in _fields():
        _add_field(spec if name in SPECULATIVE_ARGS else engine, name, f, hint)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The flat ``LLM`` keyword arguments of the flags that were given (unset ones keep the defaults)."""
    kw: dict[str, Any] = {"speculative": args.speculative}
    for name, f, hint in _fields():
        value = getattr(args, _dest(name, f))
        if value is not None:
            kw[name] = (
                _ON_OFF[value] if hint == bool | None else tuple(value) if isinstance(value, list) else value
            )
    return kw


def add_config_args(parser: argparse.ArgumentParser, cls: type[Any], title: str) -> None:
    """One flag per field of the frozen config dataclass ``cls`` (as ``add_engine_args`` does)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        _add_field(group, f.name, f, hints[f.name])


def config_kwargs(args: argparse.Namespace, cls: type[Any]) -> dict[str, Any]:
    """``cls``'s keyword arguments of the flags that were given (unset ones keep the defaults)."""
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, _dest(f.name, f))
        if value is not None:
            kw[f.name] = _ON_OFF[value] if hints[f.name] == bool | None else value
    return kw
