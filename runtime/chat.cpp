// Chat formatting for glm_moe_dsa (GLM-4.7/GLM-5 chat_template.jinja, rendered by HF with
// trim_blocks and lstrip_blocks, no tools) and deepseek_v32 (encoding_dsv32.encode_messages, no
// tools). Each branch mirrors its source line by line; see chat.h for the resulting layout.
#include "runtime/chat.h"

#include <cstdint>
#include <string_view>

#include "kernels/core/check.h"

namespace glm5::runtime {
namespace {

// Python's str.isspace() for one code point (what Jinja's .strip() removes).
bool py_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Decodes the UTF-8 char at s[i] (its length in `len`); invalid bytes decode as themselves.
uint32_t char_at(std::string_view s, size_t i, size_t& len) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) {
    len = 1;
    return 0xFFFFFFFF;
  }
  uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
  for (size_t k = 1; k < n; ++k) {
    unsigned char d = static_cast<unsigned char>(s[i + k]);
    if ((d & 0xC0) != 0x80) {
      len = 1;
      return 0xFFFFFFFF;
    }
    cp = (cp << 6) | (d & 0x3F);
  }
  len = n;
  return cp;
}

// Python's str.strip() with no argument.
std::string strip(std::string_view s) {
  size_t b = 0, len = 0;
  while (b < s.size() && py_space(char_at(s, b, len))) b += len;
  size_t e = b, keep = b;
  while (e < s.size()) {
    bool space = py_space(char_at(s, e, len));
    e += len;
    if (!space) keep = e;
  }
  return std::string(s.substr(b, keep - b));
}

std::string lstrip_newlines(std::string_view s) {
  size_t b = s.find_first_not_of('\n');
  return b == std::string_view::npos ? std::string() : std::string(s.substr(b));
}

std::string rstrip_newlines(std::string_view s) {
  size_t e = s.find_last_not_of('\n');
  return e == std::string_view::npos ? std::string() : std::string(s.substr(0, e + 1));
}

[[noreturn]] void bad_role(const std::string& model_type, size_t index, const std::string& role, const char* allowed) {
  GLM5_FAIL("format_chat(", model_type, "): messages[", index, "] has role '", role, "'; expected one of ", allowed);
}

int last_index_of(const std::vector<ChatMessage>& messages, std::initializer_list<std::string_view> roles) {
  for (size_t i = messages.size(); i-- > 0;)
    for (std::string_view r : roles)
      if (messages[i].role == r) return int(i);
  return -1;
}

std::string format_glm(const std::vector<ChatMessage>& messages, bool add_generation_prompt, bool enable_thinking) {
  const char* kRoles = "system, user, assistant, tool";
  std::string out = "[gMASK]<sop>";
  const int last_user = last_index_of(messages, {"user"});
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user") {
      out += "<|user|>" + m.content;
    } else if (m.role == "system") {
      out += "<|system|>" + m.content;
    } else if (m.role == "tool") {
      if (i == 0 || messages[i - 1].role != "tool") out += "<|observation|>";
      out += "<tool_response>" + m.content + "</tool_response>";
    } else if (m.role == "assistant") {
      out += "<|assistant|>";
      std::string reasoning = m.reasoning_content, content = m.content;
      if (reasoning.empty()) {
        // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n'), and the
        // content after the last '</think>', lstrip('\n').
        size_t first_close = content.find("</think>");
        if (first_close != std::string::npos) {
          std::string before = rstrip_newlines(std::string_view(content).substr(0, first_close));
          size_t open = before.rfind("<think>");
          reasoning = lstrip_newlines(open == std::string::npos ? std::string_view(before)
                                                                : std::string_view(before).substr(open + 7));
          size_t last_close = content.rfind("</think>");
          content = lstrip_newlines(std::string_view(content).substr(last_close + 8));
        }
      }
      if (int(i) > last_user && !reasoning.empty())
        out += "<think>" + strip(reasoning) + "</think>";
      else
        out += "</think>";
      out += strip(content);
    } else {
      bad_role("glm_moe_dsa", i, m.role, kRoles);
    }
  }
  if (add_generation_prompt) out += enable_thinking ? "<|assistant|><think>" : "<|assistant|></think>";
  return out;
}

std::string format_deepseek_v32(const std::vector<ChatMessage>& messages, bool enable_thinking) {
  const char* kRoles = "system, user, developer, assistant (tool results need tool calls, which are not supported)";
  std::string out = "<｜begin▁of▁sentence｜>";
  const int last_user = last_index_of(messages, {"user", "developer"});
  auto open_assistant = [&](size_t i) {
    out += "<｜Assistant｜>";
    out += int(i) == last_user && enable_thinking ? "<think>" : "</think>";
  };
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "system") {
      out += m.content;
    } else if (m.role == "user") {
      out += "<｜User｜>" + m.content;
      open_assistant(i);
    } else if (m.role == "developer") {
      CHECK(!m.content.empty(), "format_chat(deepseek_v32): messages[", i, "] (developer) has empty content");
      out += "<｜User｜>\n\n# The user's message is: " + m.content;
      open_assistant(i);
    } else if (m.role == "assistant") {
      // Reasoning survives only after the last user turn (earlier turns' reasoning is dropped).
      if (enable_thinking && int(i) > last_user) out += m.reasoning_content + "</think>";
      out += m.content + "<｜end▁of▁sentence｜>";
    } else {
      bad_role("deepseek_v32", i, m.role, kRoles);
    }
  }
  return out;
}

}  // namespace

std::string format_chat(const std::string& model_type, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, bool enable_thinking) {
  if (model_type == "glm_moe_dsa") return format_glm(messages, add_generation_prompt, enable_thinking);
  if (model_type == "deepseek_v32") return format_deepseek_v32(messages, enable_thinking);
  GLM5_FAIL("format_chat: model_type '", model_type, "' has no chat format; expected glm_moe_dsa or deepseek_v32");
}

}  // namespace glm5::runtime
