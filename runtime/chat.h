// Chat prompt text for the two model families, written out in C++ instead of running a Jinja
// engine: glm_moe_dsa follows zai-org GLM-4.7/GLM-5 `chat_template.jinja`, deepseek_v32 follows
// DeepSeek-V3.2's `encoding_dsv32.py`. The result is text to pass to Tokenizer::encode with
// special-token parsing on. Leaves out tools and tool calls (schemas, <tool_call>/DSML blocks),
// multimodal content parts, GLM's clear_thinking switch and response_format.
#pragma once

#include <string>
#include <vector>

namespace glm5::runtime {

struct ChatMessage {
  std::string role;  // glm_moe_dsa: system, user, assistant, tool;
                     // deepseek_v32: system, user, developer, assistant
  std::string content;
  std::string reasoning_content;  // assistant turns; empty means absent
};

// The prompt for `messages` in the format of `model_type` (HF config.json model_type). Throws
// glm5::Error for an unknown model_type or a role the format does not have (the message names
// the message index and the allowed roles).
//
// glm_moe_dsa: "[gMASK]<sop>", then "<|system|>…", "<|user|>…", "<|assistant|>" +
// "<think>R</think>" (only for assistant turns after the last user turn that carry reasoning R) or
// "</think>", then the stripped content; tool results as
// "<|observation|><tool_response>…</tool_response>". With add_generation_prompt: "<|assistant|>" +
// "<think>" (enable_thinking) or "</think>". An assistant content holding "<think>…</think>" is
// split into reasoning and content, as the template does when reasoning_content is absent.
//
// deepseek_v32: "<｜begin▁of▁sentence｜>", system text as is, each user turn as
// "<｜User｜>…<｜Assistant｜>" + "<think>" (the last user turn, enable_thinking) or "</think>",
// assistant turns as [R "</think>" when thinking and after the last user turn] + content +
// "<｜end▁of▁sentence｜>". That encoder always opens the assistant turn after a user turn, so
// add_generation_prompt changes nothing for this format.
std::string format_chat(const std::string& model_type, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, bool enable_thinking);

}  // namespace glm5::runtime
