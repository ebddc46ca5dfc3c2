// Chat formatting tests. The expected strings are what the upstream sources produce for the same
// messages: zai-org GLM-4.7 chat_template.jinja rendered by jinja2 with trim_blocks and
// lstrip_blocks (as transformers does), and DeepSeek-V3.2's encoding_dsv32.encode_messages.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/core/check.h"
#include "runtime/chat.h"
#include "runtime/tokenizer/tokenizer.h"

namespace glm5::runtime {
namespace {

using Msgs = std::vector<ChatMessage>;

std::string glm(const Msgs& m, bool gen = true, bool think = true) { return format_chat("glm_moe_dsa", m, gen, think); }
std::string dsv32(const Msgs& m, bool think = true) { return format_chat("deepseek_v32", m, true, think); }

TEST(ChatGlm, SingleUserTurn) {
  EXPECT_EQ(glm({{"user", "Hello", ""}}), "[gMASK]<sop><|user|>Hello<|assistant|><think>");
  EXPECT_EQ(glm({{"user", "Hello", ""}}, true, false), "[gMASK]<sop><|user|>Hello<|assistant|></think>");
  EXPECT_EQ(glm({{"user", " spaced \n", ""}}, false), "[gMASK]<sop><|user|> spaced \n");
  EXPECT_EQ(glm({}), "[gMASK]<sop><|assistant|><think>");
}

TEST(ChatGlm, SystemPrompt) {
  EXPECT_EQ(glm({{"system", "You are helpful.", ""}, {"user", "Hi", ""}}),
            "[gMASK]<sop><|system|>You are helpful.<|user|>Hi<|assistant|><think>");
}

TEST(ChatGlm, ReasoningKeptOnlyAfterLastUserTurn) {
  Msgs m = {{"user", "1+1?", ""}, {"assistant", "2", "add"}, {"user", "and 2+2?", ""}};
  EXPECT_EQ(glm(m), "[gMASK]<sop><|user|>1+1?<|assistant|></think>2<|user|>and 2+2?<|assistant|><think>");
  // The last turn's reasoning and content are stripped.
  EXPECT_EQ(glm({{"user", "1+1?", ""}, {"assistant", "  2  ", " add \n"}}, false),
            "[gMASK]<sop><|user|>1+1?<|assistant|><think>add</think>2");
  // Empty reasoning: a bare </think>; an empty assistant turn still closes thinking.
  EXPECT_EQ(glm({{"user", "q", ""}, {"assistant", "", ""}}, true, false),
            "[gMASK]<sop><|user|>q<|assistant|></think><|assistant|></think>");
}

TEST(ChatGlm, ThinkBlockInsideContentIsSplitOut) {
  EXPECT_EQ(glm({{"user", "q", ""}, {"assistant", "<think>\nhmm\n</think>\n\nanswer\n", ""}}, false),
            "[gMASK]<sop><|user|>q<|assistant|><think>hmm</think>answer");
  // strip() removes Unicode whitespace as Python's does (no-break and ideographic spaces).
  EXPECT_EQ(glm({{"user", "q", ""}, {"assistant", "\u00a0ok\u3000", ""}}, false),
            "[gMASK]<sop><|user|>q<|assistant|></think>ok");
}

TEST(ChatGlm, ToolResultsShareOneObservation) {
  Msgs m = {{"user", "q", ""}, {"assistant", "call", ""}, {"tool", "r1", ""}, {"tool", "r2", ""}};
  EXPECT_EQ(glm(m),
            "[gMASK]<sop><|user|>q<|assistant|></think>call<|observation|><tool_response>r1"
            "</tool_response><tool_response>r2</tool_response><|assistant|><think>");
}

TEST(ChatDeepSeekV32, Turns) {
  EXPECT_EQ(dsv32({{"user", "Hello", ""}}), "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜><think>");
  EXPECT_EQ(dsv32({{"user", "Hello", ""}}, false), "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>");
  EXPECT_EQ(dsv32({{"system", "You are helpful.", ""}, {"user", "Hi", ""}}),
            "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi<｜Assistant｜><think>");
  Msgs multi = {{"user", "1+1?", ""}, {"assistant", "2", "add"}, {"user", "and 2+2?", ""}};
  EXPECT_EQ(dsv32(multi),
            "<｜begin▁of▁sentence｜><｜User｜>1+1?<｜Assistant｜></think>2<｜end▁of▁sentence｜>"
            "<｜User｜>and 2+2?<｜Assistant｜><think>");
  EXPECT_EQ(dsv32(multi, false),
            "<｜begin▁of▁sentence｜><｜User｜>1+1?<｜Assistant｜></think>2<｜end▁of▁sentence｜>"
            "<｜User｜>and 2+2?<｜Assistant｜></think>");
  Msgs last = {{"user", "1+1?", ""}, {"assistant", "2", "add"}};
  EXPECT_EQ(dsv32(last),
            "<｜begin▁of▁sentence｜><｜User｜>1+1?<｜Assistant｜><think>add</"
            "think>2<｜end▁of▁sentence｜>");
  EXPECT_EQ(dsv32(last, false), "<｜begin▁of▁sentence｜><｜User｜>1+1?<｜Assistant｜></think>2<｜end▁of▁sentence｜>");
  EXPECT_EQ(dsv32({{"developer", "be brief", ""}}),
            "<｜begin▁of▁sentence｜><｜User｜>\n\n# The user's message is: be "
            "brief<｜Assistant｜><think>");
  // add_generation_prompt does not change this format.
  EXPECT_EQ(format_chat("deepseek_v32", {{"user", "Hello", ""}}, false, true), dsv32({{"user", "Hello", ""}}));
}

TEST(Chat, ErrorsNameTheProblem) {
  try {
    glm({{"user", "q", ""}, {"robot", "beep", ""}});
    FAIL() << "no error for role 'robot'";
  } catch (const glm5::Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("messages[1]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'robot'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("system, user, assistant, tool"), std::string::npos) << msg;
  }
  EXPECT_THROW(dsv32({{"tool", "result", ""}}), glm5::Error);
  EXPECT_THROW(dsv32({{"developer", "", ""}}), glm5::Error);
  try {
    format_chat("llama", {{"user", "q", ""}}, true, true);
    FAIL() << "no error for model_type 'llama'";
  } catch (const glm5::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'llama'"), std::string::npos) << e.what();
  }
}

// The formatted prompt tokenizes with its markers as single special tokens.
TEST(Chat, TinyTokenizerEncodesTheMarkers) {
  Tokenizer tok = Tokenizer::load(std::string(GLM5_TEST_DATA) + "/tiny-tokenizer/tokenizer.json");
  std::vector<int32_t> ids = tok.encode(glm({{"system", "sys", ""}, {"user", "hi", ""}}));
  std::vector<int32_t> want = {503, 504, 505};  // [gMASK] <sop> <|system|>
  for (int32_t id : tok.encode("sys")) want.push_back(id);
  want.push_back(510);  // <|user|>
  for (int32_t id : tok.encode("hi")) want.push_back(id);
  want.push_back(506);  // <|assistant|>
  want.push_back(507);  // <think>
  EXPECT_EQ(ids, want);
}

}  // namespace
}  // namespace glm5::runtime
