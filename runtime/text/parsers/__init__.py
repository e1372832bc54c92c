"""Output parsers for the OpenAI chat endpoint: tool calls and reasoning.

Pure Python (stdlib only), no dependency on the rest of the server, so the formats can be
tested on canned model outputs alone. Each parser gives the same answer for a whole output
(``parse``) and for the same output streamed in any fragments (``feed`` then ``finish``).
"""

from runtime.text.parsers.reasoning import (
    REASONING_PARSERS,
    NoReasoningParser,
    ReasoningParser,
    make_reasoning_parser,
)
from runtime.text.parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    HermesToolCallParser,
    Llama3ToolCallParser,
    MistralToolCallParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    make_tool_call_parser,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "HermesToolCallParser",
    "Llama3ToolCallParser",
    "MistralToolCallParser",
    "NoReasoningParser",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "make_reasoning_parser",
    "make_tool_call_parser",
]
