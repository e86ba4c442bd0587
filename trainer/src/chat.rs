//! Chat templates: a model's Jinja `chat_template` (from `tokenizer_config.json`, or a GGUF
//! file's `tokenizer.chat_template`) rendered the way transformers' `apply_chat_template`
//! renders it, so prompts reach an instruct model in the format it was trained on.

use minijinja::{context, Environment, Error as JinjaError};
use serde::Serialize;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{0} has no chat_template")]
    NoTemplate(String),
    #[error("reading {path}: {message}")]
    Read { path: String, message: String },
    #[error("the chat template does not render: {0}")]
    Render(#[from] JinjaError),
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
        let text = std::fs::read_to_string(path).map_err(|e| read(e.to_string()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| read(e.to_string()))?;
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
        Ok(t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })?)
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
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

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

    #[test]
    fn template_errors_are_reported() {
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
    }
}
