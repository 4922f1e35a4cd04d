"""The tool-call parsers by the name `--tool-call-parser` takes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from pdserve.services.router.http.tools.hermes import HermesParser
from pdserve.services.router.http.tools.llama3_json import Llama3JsonParser
from pdserve.services.router.http.tools.parsers import Extractor

PARSERS: Mapping[str, Callable[[], Extractor]] = MappingProxyType(
    {"hermes": HermesParser, "llama3_json": Llama3JsonParser})
PARSER_NAMES = tuple(PARSERS)


def parser_factory(name: str) -> Callable[[], Extractor]:
    """The parser registered as `name` (ValueError naming --tool-call-parser otherwise)."""
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r} (one of {', '.join(sorted(PARSERS))})")
    return PARSERS[name]
