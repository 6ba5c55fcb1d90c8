"""Campaign YAML -> :class:`Campaign`, every problem reported as one error naming the file.

A DAG file calls :func:`load_campaign` at parse time, so an error here is what a user sees
in the Airflow UI's import errors: it names the file, each field's dotted path and, where
the YAML tells us, the line, and suggests the key that was probably meant.
"""

from __future__ import annotations

import codecs
import difflib
import itertools
import os
import re
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel, ValidationError

from operators.campaign.schema.config import MAX_PREFIXES, Campaign


class Problem(NamedTuple):
    field: str  # dotted path such as training.lr_warmup_iters; "" for the whole file
    message: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    def located(self, path: str) -> str:
        """``file:line: field: message``, the form compilers use, which editors and CI
        annotations jump to."""
        return f"{path}:{self.line}: {self}" if self.line else f"{path}: {self}"


class CampaignConfigError(ValueError):
    """A campaign file that cannot be used: every problem in it, in one message."""

    def __init__(self, path: str, problems: list[Problem]) -> None:
        self.path = path
        self.problems = problems
        lines = [p.located(path) for p in problems]
        super().__init__(lines[0] if len(lines) == 1
                         else "invalid campaign config\n" + "\n".join(lines))

    @property
    def fields(self) -> list[str]:
        return [p.field for p in self.problems]


# A campaign is a page of settings: anything bigger is a mistake (a dataset pasted in, a
# runaway generator), and reading it would cost every DAG parse.
MAX_FILE_BYTES = 1 << 20
# No campaign number needs more (a token count fits in 20 digits); Python refuses to parse
# more than 4300 digits at all, with an error that names no line.
MAX_INT_DIGITS = 20
INT_LIMIT = 2**63  # an int64: what Slurm, Megatron and JSON readers all take
MAX_PROBLEMS = 50  # reported per file: enough to fix a file, and bounded work for a huge one
# Checked on the YAML tree, before any value is built or validated, so the work a file costs
# is bounded by them (anchors and aliases included: an alias counts each time it is used).
# The longest list a campaign has is data.prefixes / data.blend; the schema's own caps on each
# field are tighter and still apply.
MAX_ENTRIES = MAX_PREFIXES  # keys of one section, items of one list
MAX_VALUES = 8 * MAX_PREFIXES  # every key, item and value of the file (a blend item is 5)


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """SafeLoader (libyaml's when present: DAG files load campaigns at every parse) that
    refuses duplicate keys (PyYAML keeps the last one silently), complex keys
    (``? [a, b]``) and integers beyond int64, and reads ``1e-4`` as a number (YAML 1.1
    wants ``1.0e-4``; learning rates are written the short way)."""

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, OverflowError) as exc:  # e.g. a date of 2026-02-30
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read this value: {exc}", node.start_mark) from None

    def construct_yaml_int(self, node):
        digits = sum(ch.isdigit() for ch in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {digits} digits is out of range", node.start_mark)
        value = super().construct_yaml_int(node)
        if not -INT_LIMIT <= value < INT_LIMIT:
            raise yaml.constructor.ConstructorError(
                None, None, f"integer {value} is out of range (64-bit)", node.start_mark)
        return value

    def construct_mapping(self, node, deep=False):
        if not isinstance(node, yaml.MappingNode):
            return super().construct_mapping(node, deep=deep)  # raises, with its mark
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise yaml.constructor.ConstructorError(
                    None, None, "a key must be a plain name, not a list or mapping",
                    key_node.start_mark)
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key]})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _too_many_events(loader: _Loader) -> Problem | None:
    """:func:`_oversized` on the parser's events, before a tree is built: it stops at the
    first section or list over :data:`MAX_ENTRIES`, so composing never sees one (the
    composer's cost per node is most of what a huge file costs)."""
    seen = 0
    # per open collection: [is_mapping, children so far, loc, line, current key, its line]
    stack: list[list] = []
    while not loader.check_event(yaml.StreamEndEvent):
        event = loader.get_event()
        if isinstance(event, yaml.CollectionEndEvent):
            stack.pop()
            continue
        if not isinstance(event, yaml.NodeEvent):  # stream and document marks
            continue
        seen += 1
        loc: tuple = ()
        line = event.start_mark.line + 1
        if stack:
            top = stack[-1]
            is_mapping, children, top_loc = top[0], top[1], top[2]
            if is_mapping and children % 2 == 0:  # a key
                top[4] = event.value if isinstance(event, yaml.ScalarEvent) else "?"
                top[5] = line
                loc = top_loc
            elif is_mapping:  # a value: named, and placed, by its key
                loc, line = (*top_loc, top[4]), top[5]
            else:
                loc = (*top_loc, children)
            top[1] += 1
            entries = (top[1] + 1) // 2 if is_mapping else top[1]
            if entries > MAX_ENTRIES:
                what = "keys" if is_mapping else "items"
                return Problem(_dotted(top_loc), f"more than {MAX_ENTRIES} {what} (the cap)",
                               top[3])
        if seen > MAX_VALUES:
            return _too_many_values(loc, line)
        if isinstance(event, yaml.CollectionStartEvent):
            stack.append([isinstance(event, yaml.MappingStartEvent), 0, loc, line, None, None])
    return None


def _too_many_values(loc: tuple, line: int) -> Problem:
    return Problem(_dotted(loc), f"the file holds more than {MAX_VALUES} YAML values (the cap; "
                                 "keys, list items and values, an alias counting each time "
                                 "it is used): a campaign is a page of settings", line)


def _oversized(root: yaml.Node) -> Problem | None:
    """The first section or list over :data:`MAX_ENTRIES`, or the file over
    :data:`MAX_VALUES`, named by its dotted field and line; one pass over the tree."""
    seen = 0
    # (node, loc, line): a mapping's value is placed by its key's line
    stack: list[tuple[yaml.Node, tuple, int]] = [(root, (), root.start_mark.line + 1)]
    while stack:
        node, loc, line = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            return _too_many_values(loc, line)
        if isinstance(node, yaml.MappingNode | yaml.SequenceNode):
            if len(node.value) > MAX_ENTRIES:
                what = "keys" if isinstance(node, yaml.MappingNode) else "items"
                return Problem(_dotted(loc), f"more than {MAX_ENTRIES} {what} (the cap)", line)
            if isinstance(node, yaml.MappingNode):
                seen += len(node.value)  # the keys
                stack.extend((value, (*loc, str(key.value)), key.start_mark.line + 1)
                             for key, value in node.value)
            else:
                stack.extend((item, (*loc, i), item.start_mark.line + 1)
                             for i, item in enumerate(node.value))
    return None


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line(root: yaml.Node | None, loc: tuple) -> int | None:
    """The 1-based line of the YAML node at ``loc`` (of its key, for mapping entries)."""
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if key_node.value == str(part):
                    node, line = value_node, key_node.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) \
                and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):  # X | None, list[X]
        found = _submodel(arg)
        if found is not None:
            return found
    return None


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The schema section that holds the last part of ``loc``, for key suggestions."""
    model: type[BaseModel] | None = Campaign
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if model else None
        model = _submodel(field.annotation) if field else None
    return model


def _message(error: dict) -> str:
    loc = tuple(p for p in error["loc"] if p != "[key]")
    if error["type"] == "extra_forbidden":
        model = _model_at(loc)
        known = list(model.model_fields) if model else []
        near = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        return f"unknown key{hint} (allowed: {', '.join(known)})" if known else "unknown key"
    if error["type"] == "missing":
        return "required key is missing"
    return error["msg"].removeprefix("Value error, ")


def _expanded(errors: list[dict]):
    """Cross-field errors carry (path, message) pairs: one error each, at its own path."""
    for error in errors:
        if error["type"] != "cross_field":
            yield error
            continue
        for path, message in error["ctx"]["problems"]:
            yield {"type": "cross_field", "loc": tuple(path.split(".")), "msg": message}


def campaign_from_dict(raw: Any, path: str = "<campaign>", root: yaml.Node | None = None):
    """Validate an already-parsed document; raises :class:`CampaignConfigError`."""
    if not isinstance(raw, dict):
        raise CampaignConfigError(path, [Problem("", "the document must be a mapping of sections")])
    try:
        return Campaign.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for error in itertools.islice(_expanded(exc.errors()), MAX_PROBLEMS):
            loc = tuple(error["loc"])
            field = _dotted(tuple(p for p in loc if p != "[key]"))
            problems.append(Problem(field, _message(error), _line(root, loc)))
        if exc.error_count() > len(problems):
            problems.append(Problem("", f"... and {exc.error_count() - len(problems)} more "
                                        "problem(s)"))
        raise CampaignConfigError(path, problems) from None


def _decoded(path: str, data: bytes) -> str:
    """The file as text: UTF-8 only (what the dag-processor and every editor default to)."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise CampaignConfigError(path, [Problem("", "the file is UTF-16 (it starts with a "
                                                     "UTF-16 byte order mark): save it as "
                                                     "UTF-8")])
    if b"\x00" in data:
        raise CampaignConfigError(path, [Problem("", "the file holds NUL bytes: it is not a "
                                                     "text file")])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise CampaignConfigError(path, [Problem(
            "", f"not UTF-8: byte 0x{data[exc.start]:02x} at column {column} (a Latin-1 or "
                "other legacy encoding?); save the file as UTF-8", line)]) from None


def load_campaign(path: str | os.PathLike[str]) -> Campaign:
    """Read and validate one campaign file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise CampaignConfigError(path, [Problem("", f"cannot read: {exc.strerror or exc}")]) \
            from None
    if len(data) > MAX_FILE_BYTES:
        raise CampaignConfigError(path, [Problem(
            "", f"the file is over {MAX_FILE_BYTES >> 10} KiB: a campaign is a page of settings")])
    text = _decoded(path, data)
    try:
        counter = _Loader(text)
        try:
            too_big = _too_many_events(counter)
        finally:
            counter.dispose()
        if too_big is not None:
            raise CampaignConfigError(path, [too_big])
        loader = _Loader(text)
        try:  # the parse that builds: the node tree gives error lines, the document values
            root = loader.get_single_node()
            too_big = _oversized(root) if root is not None else None
            if too_big is not None:
                raise CampaignConfigError(path, [too_big])
            raw = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = " ".join(p for p in (exc.context, exc.problem) if p)
        if mark:
            what += f" (column {mark.column + 1})"
        kind = "YAML" if isinstance(exc, yaml.constructor.ConstructorError) else "YAML syntax error"
        raise CampaignConfigError(path, [Problem("", f"{kind}: {what}",
                                                 mark.line + 1 if mark else None)]) from None
    except yaml.YAMLError as exc:
        raise CampaignConfigError(path, [Problem("", f"YAML error: {exc}")]) from None
    except RecursionError:
        raise CampaignConfigError(path, [Problem("", "the YAML is nested too deeply")]) from None
    return campaign_from_dict(raw, path, root)
