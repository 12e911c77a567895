"""Tool calling for /v1/chat/completions (OpenAI's `tools`, `tool_choice`,
`parallel_tool_calls`):

- `plan`      what a request does with its tools: checks, the template's call format, the
              `Guided` constraint of `required` / a named function, the prompt's messages
- `parsers`   calls in the model's own text as it arrives: Hermes `<tool_call>`, Llama 3 JSON
- `forced`    the schema `required` / a named function hold the output to, and its parsers
- `jsonscan`  an incremental JSON checker the parsers read calls with
- `stream`    a parser's events as OpenAI stream deltas and as the whole message
"""

from mooncake.api.tools.plan import ToolPlan, plan_tools, prompt_messages
from mooncake.api.tools.stream import ToolStream

__all__ = ["ToolPlan", "ToolStream", "plan_tools", "prompt_messages"]
