"""Parse a model's JSON, YAML or XML answer, and check it against a JSON Schema.

Tolerant of the wrapping models put around an answer: a Markdown code fence (the first one is the
answer) and prose before it (and after it, once the structure has ended). Strict about the
content: no repairs (single quotes, trailing commas, NaN, duplicate keys are errors), because a
repaired answer is one the model did not give. A failed parse raises ParseError saying why and
where.

What a parse returns, for schema checks and comparisons:
- JSON: the value (object, array, or a scalar when the whole text is one).
- YAML: a mapping or a list; a bare scalar is refused, since any prose is a YAML string.
- XML: the content of the root element: a leaf's text (a string; XML has no numbers), or a dict of
  child tag to value (a list when a tag repeats) with attributes as "@name" keys.
"""

import json
import re
import xml.etree.ElementTree as ElementTree

import jsonschema
import yaml

from lmforge.common.errors import LmforgeError

FORMATS = ("json", "yaml", "xml")

# ```json ... ``` (any or no language tag) with both fences at the start of a line, as in Markdown,
# so that backticks inside an answer's strings are content; the answer is the first fenced block.
_FENCE = re.compile(r"^```[^\n`]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
_FENCE_OPEN = re.compile(r"^```", re.MULTILINE)
# The first line of a YAML block: a document start, a list item, or `key:` with a one-word key,
# so that leading prose such as "Here is the answer:" is not taken for a mapping.
_YAML_START = re.compile(r"^(---|- |-$|[\"']?[A-Za-z_][\w.-]*[\"']?[ \t]*:([ \t]|$))", re.MULTILINE)
_XML_START = re.compile(r"<(\?xml|[A-Za-z_])")


class ParseError(LmforgeError):
    """An answer that does not parse in its format, or does not match its schema; says why."""


def parse_answer(text: str, fmt: str):
    """The value of the `fmt` answer in `text` (see the module docstring); ParseError if none."""
    parsers = {"json": _parse_json, "yaml": _parse_yaml, "xml": _parse_xml}
    if fmt not in parsers:
        raise LmforgeError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    fence = _FENCE.search(text)
    if fence:
        return parsers[fmt](fence.group(1), fenced=True)
    if _FENCE_OPEN.search(text):
        raise ParseError("a code fence is opened but never closed")
    return parsers[fmt](text, fenced=False)


def check_schema(value, schema: dict) -> None:
    """ParseError naming the first violation (and where) if `value` does not match `schema`."""
    validator = jsonschema.validators.validator_for(schema)(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is not None:
        where = "".join(f"[{p!r}]" for p in error.absolute_path) or "the top level"
        raise ParseError(f"schema violation at {where}: {error.message}")


def _line_col(text: str, index: int) -> str:
    line = text.count("\n", 0, index) + 1
    return f"line {line} column {index - (text.rfind(chr(10), 0, index) + 1) + 1}"


def _check_unique(keys: list) -> None:
    """ParseError for a key given twice (json and PyYAML would silently keep the last)."""
    for key in keys:
        if keys.count(key) > 1:
            raise ParseError(f"duplicate key {key!r}")


def _no_duplicates(pairs):
    _check_unique([key for key, _ in pairs])
    return dict(pairs)


def _no_constants(name):
    raise ParseError(f"{name} is not JSON")


def _parse_json(text: str, fenced: bool):
    decoder = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    body = text.strip()
    if fenced or body[:1] in ("{", "["):
        start = text.index(body[:1]) if body else 0
    else:
        try:  # a bare scalar answer such as `42` or `"yes"`
            return decoder.decode(body)
        except ValueError:
            pass
        match = re.search(r"[{\[]", text)
        if match is None:
            raise ParseError("no JSON object or array in the answer")
        start = match.start()
    try:
        value, end = decoder.raw_decode(text, start)
    except json.JSONDecodeError as err:
        raise ParseError(f"invalid JSON at {_line_col(text, err.pos)}: {err.msg}") from None
    rest = text[end:]
    # Prose may follow the answer, but only after a space or newline: `{"a": 1}}` is broken JSON.
    if rest.strip() and (fenced or not rest[0].isspace()):
        raise ParseError(f"unexpected text after the JSON value at {_line_col(text, end)}: {rest.strip()[:20]!r}")
    return value


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing duplicate keys (which it would silently overwrite)."""

    def construct_mapping(self, node, deep=False):
        _check_unique([self.construct_object(key, deep=deep) for key, _ in node.value])
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(text: str, fenced: bool):
    if not fenced:
        start = _YAML_START.search(text)
        if start is None:
            raise ParseError("no YAML mapping or list in the answer")
        text = text[start.start():]
    try:
        value = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ParseError(f"invalid YAML{where}: {problem}") from None
    if not isinstance(value, (dict, list)):
        raise ParseError(f"the YAML answer is a {type(value).__name__}, not a mapping or list")
    return value


def _parse_xml(text: str, fenced: bool):
    # Refuse DTDs: entity definitions are how XML parsers are made to expand without bound.
    if "<!DOCTYPE" in text or "<!ENTITY" in text:
        raise ParseError("XML with a DTD (<!DOCTYPE or <!ENTITY) is not accepted")
    start = _XML_START.search(text)
    if start is None:
        raise ParseError("no XML element in the answer")
    end = len(text.rstrip()) if fenced else text.rfind(">") + 1
    body = text[start.start():end]
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError as err:
        line, column = err.position
        raise ParseError(f"invalid XML at line {line} column {column + 1}: {str(err).split(':')[0]}") from None
    return _xml_value(root)


def _xml_value(element):
    children = list(element)
    if not children:
        value = (element.text or "").strip()
        return {**_attributes(element), "#text": value} if element.attrib else value
    if (element.text or "").strip() or any((child.tail or "").strip() for child in children):
        raise ParseError(f"<{element.tag}> mixes text and elements")
    value = _attributes(element)
    for child in children:
        item = _xml_value(child)
        if child.tag not in value:
            value[child.tag] = item
        elif isinstance(value[child.tag], list):  # an element's value is never itself a list
            value[child.tag].append(item)
        else:
            value[child.tag] = [value[child.tag], item]
    return value


def _attributes(element) -> dict:
    return {f"@{name}": value for name, value in element.attrib.items()}
