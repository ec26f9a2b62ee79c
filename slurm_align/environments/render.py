"""The environment's reply messages as the tokens that follow the model's turn in the trajectory.

Chat rows (the prompt was rendered by the chat template): the tokens are the template's own
rendering of the conversation past the model's turn, so the trajectory reads as
`apply_chat_template(conversation + reply, add_generation_prompt=True)` does; the end of the
model's turn that the template writes (e.g. Qwen's "<|im_end|>\\n") and the model did not
generate (its turn stopped at "</tool_call>") comes first, also the environment's.
Plain rows ([BOS] prompt, no template): a tool answer is
"\\n<tool_response>\\n{content}\\n</tool_response>\\n" (Qwen2.5's tool-turn text), any other
message "\\n{content}\\n"; SFT data that shows tool calls uses the same text.
"""

from __future__ import annotations

from typing import Any

from slurm_align.environments.base import Messages


def plain_text(message: dict[str, Any]) -> str:
    if message["role"] == "tool":
        return f"\n<tool_response>\n{message['content']}\n</tool_response>\n"
    return f"\n{message['content']}\n"


class TurnRenderer:
    """Token ids of an environment reply (and of a chat row's first messages)."""

    def __init__(self, tokenizer, tools: list[dict[str, Any]] | None):
        self.tok, self.tools = tokenizer, tools

    def _render(self, messages: Messages, generation: bool) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=generation, tools=self.tools)

    def prompt(self, messages: Messages) -> list[int]:
        """A chat row's first messages with the generation prompt (and the tools' schemas)."""
        return self.tok.encode(self._render(messages, True))

    def reply(self, messages: Messages, reply: Messages, chat: bool) -> list[int]:
        """Tokens of `reply` after `messages`, whose last message is the model's raw turn."""
        return self.tok.encode(self.reply_text(messages, reply, chat)) if reply else []

    def reply_text(self, messages: Messages, reply: Messages, chat: bool) -> str:
        """The text of `reply` after `messages` (see the module doc)."""
        if not chat:
            return "".join(plain_text(m) for m in reply)
        before = self._render(messages[:-1], True)
        with_turn = self._render(messages, False)
        full = self._render(messages + reply, True)
        if not (with_turn.startswith(before) and full.startswith(with_turn)):
            raise ValueError("the chat template does not render the conversation as a prefix of itself "
                             "plus the next turn; multi-turn rollouts need a template that does")
        turn, model_text = with_turn[len(before):], messages[-1]["content"]
        cut = turn.rfind(model_text) if model_text else len(turn)
        closing = turn[cut + len(model_text):] if cut >= 0 else ""
        return closing + full[len(with_turn):]
