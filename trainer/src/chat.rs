//! Chat templates: a model's Jinja `chat_template` (from `tokenizer_config.json`, or a GGUF
//! file's `tokenizer.chat_template`) rendered the way transformers' `apply_chat_template`
//! renders it, so prompts reach an instruct model in the format it was trained on. The template
//! is code from the model's files: minijinja runs it without access to files or the network, and
//! each render is bounded ([`FUEL`] instructions), so a template that never ends fails with a
//! message instead of hanging the run.
//!
//! Instructions, not memory: minijinja caps a string repeated with `*` (100 MB) but not one built
//! with `~`, so a template that doubles a string in a loop (`namespace` and `ns.s ~ ns.s`) holds
//! 1 GB after 27 iterations, a few hundred instructions, and exhausts memory soon after
//! (measured 2026-12-03, minijinja 2.24; Jinja2's sandbox, which transformers uses, has no such cap
//! either). Only the pretrained demo renders a template, its pinned and checksummed model's.

use minijinja::{context, Environment, Error as JinjaError};
use serde::Serialize;
use std::path::Path;

/// The most template instructions one render may run: 23 to 53 per message for the templates
/// of SmolLM2, Llama 3, Gemma 3 and DeepSeek-V3 (measured at 100 messages), so tens of
/// thousands of messages fit; a template whose loops do not end stops here, in about 0.2 s.
pub const FUEL: u64 = 5_000_000;

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{0} has no chat_template")]
    NoTemplate(String),
    #[error("reading {path}: {message}")]
    Read { path: String, message: String },
    #[error("the chat template does not render: {0}")]
    Render(#[from] JinjaError),
    #[error(
        "the chat template ran more than {FUEL} instructions for one conversation of {messages} \
         messages (a loop that does not end?)"
    )]
    Runaway { messages: usize },
}

/// One message of a conversation.
#[derive(Debug, Clone, Serialize)]
pub struct Message<'a> {
    pub role: &'a str,
    pub content: &'a str,
}

/// A parsed chat template with the special tokens transformers passes to it.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Parses `template`; `bos_token`/`eos_token` are what the template sees under those names.
    pub fn new(
        template: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, ChatError> {
        let mut env = Environment::new();
        // transformers renders with `trim_blocks` and `lstrip_blocks` on.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        // Python's str/dict/list methods, as transformers' Jinja2 has them (Qwen3's template
        // calls `startswith`, `split`, `rstrip`, …).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, JinjaError> {
                Err(JinjaError::new(minijinja::ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", template.to_string())?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template of a model directory's `tokenizer_config.json`.
    pub fn from_tokenizer_config(path: &Path) -> Result<ChatTemplate, ChatError> {
        let read = |message: String| ChatError::Read {
            path: path.display().to_string(),
            message,
        };
        let text = xdistill_shared::hf::read_capped(
            path,
            xdistill_shared::hf::limits::TOKENIZER_CONFIG_JSON,
            "tokenizer_config.json",
        )
        .map_err(|e| read(e.to_string()))?;
        let v: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| read(e.to_string()))?;
        let token = |key: &str| match &v[key] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Object(o) => o
                .get("content")
                .and_then(|c| c.as_str())
                .unwrap_or_default()
                .to_string(),
            _ => String::new(),
        };
        let template = v["chat_template"]
            .as_str()
            .ok_or_else(|| ChatError::NoTemplate(path.display().to_string()))?;
        ChatTemplate::new(template, &token("bos_token"), &token("eos_token"))
    }

    /// The conversation as the model sees it; with `add_generation_prompt` it ends where the
    /// assistant's answer begins.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let t = self.env.get_template("chat")?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| match e.kind() {
            minijinja::ErrorKind::OutOfFuel => ChatError::Runaway {
                messages: messages.len(),
            },
            _ => ChatError::Render(e),
        })
    }

    /// The end-of-turn token the template closes messages with (its `eos_token`).
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-Instruct's template, as its GGUF file and `tokenizer_config.json` carry it.
    pub(super) const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_like_transformers() {
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let user = [Message {
            role: "user",
            content: "What is 2+2?",
        }];
        // transformers 5.24: tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
        // tokenize=False, add_generation_prompt=True)
        assert_eq!(
            t.render(&user, true).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
             Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
        let with_system = [
            Message {
                role: "system",
                content: "Be brief.",
            },
            Message {
                role: "user",
                content: "Hi",
            },
        ];
        assert_eq!(
            t.render(&with_system, false).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    /// A template whose loops run for ever (10^10 iterations) stops at the fuel limit with a
    /// message, in well under a second; a long real conversation (2,000 messages, SmolLM2's
    /// template) is far inside the limit.
    #[test]
    fn runaway_templates_stop_and_long_conversations_render() {
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let t0 = std::time::Instant::now();
        let e = t.render(&[], false).unwrap_err();
        assert!(matches!(e, ChatError::Runaway { messages: 0 }), "{e}");
        assert!(e.to_string().contains("instructions"), "{e}");
        eprintln!("runaway template stopped after {:?}", t0.elapsed());
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let turns: Vec<Message> = (0..2000)
            .map(|i| Message {
                role: if i % 2 == 0 { "user" } else { "assistant" },
                content: "Tell me more.",
            })
            .collect();
        let text = t.render(&turns, true).unwrap();
        assert_eq!(text.matches("<|im_start|>user").count(), 1000);
    }

    /// Real models' templates (the tokenizers' `tokenizer_config.json`) render a conversation
    /// with a system message, a past answer and a generation prompt as transformers renders it.
    /// Expected: Jinja2 3.1.6 in transformers' environment (sandboxed, `trim_blocks`,
    /// `lstrip_blocks`, loop controls, `tojson` without ASCII escapes, `raise_exception`),
    /// `template.render(messages=…, add_generation_prompt=True, bos_token=…, eos_token=…)`.
    /// Qwen3's calls Python string methods (`startswith`, `split`, `rstrip`): minijinja-contrib's
    /// pycompat; Gemma 3's folds the system message into the first user turn.
    #[test]
    fn real_templates_render_like_jinja2() {
        let conversation = [
            Message {
                role: "system",
                content: "Answer briefly.",
            },
            Message {
                role: "user",
                content: "What is 2+2?",
            },
            Message {
                role: "assistant",
                content: "4.",
            },
            Message {
                role: "user",
                content: "And 3+3?",
            },
        ];
        let want = [
            (
                "qwen3",
                "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 2+2?\
                 <|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nAnd 3+3?\
                 <|im_end|>\n<|im_start|>assistant\n",
            ),
            (
                "llama3",
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.\
                 <|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>\
                 <|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>\
                 <|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>\
                 <|start_header_id|>assistant<|end_header_id|>\n\n",
            ),
            (
                "gemma3",
                "<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is 2+2?<end_of_turn>\n\
                 <start_of_turn>model\n4.<end_of_turn>\n<start_of_turn>user\nAnd 3+3?\
                 <end_of_turn>\n<start_of_turn>model\n",
            ),
            (
                "deepseek_v3",
                "<\u{ff5c}begin\u{2581}of\u{2581}sentence\u{ff5c}>Answer briefly.\
                 <\u{ff5c}User\u{ff5c}>What is 2+2?<\u{ff5c}Assistant\u{ff5c}>4.\
                 <\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}><\u{ff5c}User\u{ff5c}>And 3+3?\
                 <\u{ff5c}Assistant\u{ff5c}>",
            ),
        ];
        for (name, want) in want {
            let config = xdistill_testkit::assets::tokenizer_json(name)
                .with_file_name("tokenizer_config.json");
            let t = ChatTemplate::from_tokenizer_config(&config).unwrap();
            assert_eq!(t.render(&conversation, true).unwrap(), want, "{name}");
        }
    }

    #[test]
    fn template_errors_are_reported() {
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
    }
}
