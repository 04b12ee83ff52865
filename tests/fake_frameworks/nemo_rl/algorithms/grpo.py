"""Replica of nemo_rl/algorithms/grpo.py (7ea279abfbeb): the message-level advantage penalties.

`_apply_message_level_advantage_penalties(train_data, message_logs, ...)` overwrites the
advantages of flagged assistant-message spans in place, on purpose. GRPO's advantages
can be per-sample values expanded over tokens (stride 0); since 09b63d9bd (#2787) they
are cloned before the first span write, so a span changes only its own tokens.
"""

from __future__ import annotations

from typing import Any, Optional


def _apply_message_level_advantage_penalties(train_data: Any, message_logs: list[list[dict[str, Any]]],
                                             invalid_tool_call_advantage: Optional[float],
                                             malformed_thinking_advantage: Optional[float],
                                             log_config: bool = False) -> Optional[dict[str, float]]:
    if invalid_tool_call_advantage is None and malformed_thinking_advantage is None:
        return None
    advantages = train_data["advantages"]
    materialized = False
    penalised = 0
    for i, message_log in enumerate(message_logs):
        offset = 0
        for message in message_log:
            length = len(message["token_ids"])
            assistant = message["role"] == "assistant" and "generation_logprobs" in message
            invalid = assistant and invalid_tool_call_advantage is not None and message.get("is_invalid_tool_call")
            malformed = (assistant and malformed_thinking_advantage is not None
                         and message.get("has_malformed_thinking"))
            if (invalid or malformed) and not materialized:
                advantages = advantages.clone()  # 09b63d9bd: the expanded view shares one value per row
                train_data["advantages"] = advantages
                materialized = True
            if invalid:
                advantages[i, offset:offset + length] = invalid_tool_call_advantage  # the span write
                penalised += 1
            elif malformed:
                advantages[i, offset:offset + length] = malformed_thinking_advantage  # the span write
                penalised += 1
            offset += length
    return {"penalised_messages": float(penalised)}
