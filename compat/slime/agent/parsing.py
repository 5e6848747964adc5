"""slime.agent.parsing: a decoded model output split into reasoning, visible text and tool uses. slime hands the
formats to SGLang's parsers; here the rollout gateway's own tool-call parser reads the Qwen/Hermes JSON format
(tool_parser_name qwen25, qwen, hermes), the XML format is qwen3_coder's (and the fallback for any parser, as in
slime), and a reasoning parser of any name splits at the first `</think>`."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from services.rollout.gateway.toolcalls import parse_tool_calls

JSON_TOOL_PARSERS = ("qwen25", "qwen", "hermes")
XML_TOOL_PARSERS = ("qwen3_coder",)
_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>]+)>(.*?)</parameter>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ParsedModelOutput:
    reasoning: str
    text: str
    tool_uses: list[dict[str, Any]]
    ill_formed: bool = False


def parse_model_output(raw_output: str, *, tools_schema: list[dict] | None, tool_parser_name: str | None,
                       reasoning_parser_name: str | None) -> ParsedModelOutput:
    """Reasoning (with a reasoning parser), the visible text, and the tool uses ({"name", "input"})."""
    reasoning, body = "", raw_output
    if reasoning_parser_name and "</think>" in raw_output:
        reasoning, body = raw_output.split("</think>", 1)
        reasoning = reasoning.replace("<think>", "", 1).strip()
    body, tool_uses, ill_formed = parse_tool_uses(body, tools_schema, tool_parser_name)
    return ParsedModelOutput(reasoning=reasoning, text=(body or "").strip(), tool_uses=tool_uses,
                             ill_formed=ill_formed)


def parse_tool_uses(body_text: str, tools_schema: list[dict] | None,
                    tool_parser_name: str | None) -> tuple[str, list[dict[str, Any]], bool]:
    """(visible text, tool uses, ill_formed). A parser name this module does not read raises ValueError."""
    tool_uses: list[dict[str, Any]] = []
    if tool_parser_name and tools_schema:
        if tool_parser_name in JSON_TOOL_PARSERS:
            names = {tool.get("function", {}).get("name") for tool in tools_schema}
            body_text, calls = parse_tool_calls(body_text, names)
            tool_uses = [{"name": call.name, "input": call.arguments} for call in calls]
        elif tool_parser_name not in XML_TOOL_PARSERS:
            raise ValueError(f"slime.agent.parsing: tool parser {tool_parser_name!r} is not provided here; use one "
                             f"of {', '.join(JSON_TOOL_PARSERS + XML_TOOL_PARSERS)}")
    if not tool_uses and tools_schema:
        body_text, tool_uses = parse_xml_tool_uses(body_text, tools_schema)
    return body_text, tool_uses, False


def parse_xml_tool_uses(body_text: str, tools_schema: list[dict]) -> tuple[str, list[dict[str, Any]]]:
    """`<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>` blocks of declared tools,
    taken out of the text; parameters as stripped strings."""
    declared = {tool.get("function", {}).get("name") for tool in tools_schema}
    tool_uses: list[dict[str, Any]] = []
    kept, last = [], 0
    for match in _XML_CALL.finditer(body_text):
        if match.group(1) not in declared:
            continue
        tool_uses.append({"name": match.group(1),
                          "input": {p.group(1): p.group(2).strip() for p in _XML_PARAMETER.finditer(match.group(2))}})
        kept.append(body_text[last:match.start()])
        last = match.end()
    kept.append(body_text[last:])
    return "".join(kept), tool_uses


__all__ = ["ParsedModelOutput", "parse_model_output", "parse_tool_uses", "parse_xml_tool_uses"]
