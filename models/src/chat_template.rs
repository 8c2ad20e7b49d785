//! Hugging Face chat templates, rendered with minijinja the way `apply_chat_template` renders
//! them with Jinja2, so that `/v1/chat/completions` builds byte-for-byte the prompt the model was
//! trained on.
//!
//! Jinja2 behaviour reproduced: `trim_blocks` and `lstrip_blocks` on, trailing newline dropped,
//! no auto-escaping, `raise_exception(msg)`, `strftime_now(fmt)`, `tojson` with Python's
//! `json.dumps` output (`", "`/`": "` separators, `indent`, `sort_keys`, `separators`,
//! `ensure_ascii`), Python string and dict methods (`.strip()`, `.split()`, `.items()`; through
//! minijinja-contrib's pycompat), `namespace()`, `loop`, `messages[::-1]`, `{% break %}` and
//! `{% continue %}`. Not reproduced: the `{% generation %}` tag (training-only).

use std::collections::BTreeMap;
use std::io;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value};
use minijinja::{AutoEscape, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::{ModelError, Result};

/// One message of a conversation, as the template sees it (`message.role`, `message['content']`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, or whatever else the template accepts.
    pub role: String,
    /// The message text.
    pub content: String,
}

/// The special tokens templates print themselves (`{{ bos_token }}`); `None` renders as nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning-of-sequence token text, e.g. `<s>`.
    pub bos_token: Option<String>,
    /// End-of-sequence token text, e.g. `</s>` or `<|im_end|>`.
    pub eos_token: Option<String>,
}

impl SpecialTokens {
    /// Reads `bos_token` / `eos_token` from the contents of a `tokenizer_config.json`. Each may be
    /// a string, an AddedToken object (`{"content": ...}`) or null; `origin` names the file.
    pub fn from_tokenizer_config_json(text: &str, origin: &str) -> Result<Self> {
        Self::from_config(&parse_config(text, origin)?, origin)
    }

    fn from_config(config: &serde_json::Map<String, Json>, origin: &str) -> Result<Self> {
        let token = |key: &str| match config.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::String(text)) => Ok(Some(text.clone())),
            Some(Json::Object(added)) => match added.get("content") {
                Some(Json::String(text)) => Ok(Some(text.clone())),
                _ => Err(json_error(
                    origin,
                    format!("`{key}` has no string `content`"),
                )),
            },
            Some(_) => Err(json_error(
                origin,
                format!("`{key}` must be a string, an AddedToken object or null"),
            )),
        };
        Ok(Self {
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
        })
    }
}

/// A compiled chat template with the special tokens it prints.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    origin: String,
    source: String,
    special: SpecialTokens,
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is [`ModelError::Template`] naming `origin` (the file the
    /// template came from) and the line.
    pub fn new(source: &str, origin: &str, special: SpecialTokens) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        // Chat templates produce prompts, not HTML: never escape, whatever the origin's extension.
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(origin.to_owned(), source.to_owned())
            .map_err(|e| template_error(origin, &e))?;
        Ok(Self {
            env,
            origin: origin.to_owned(),
            source: source.to_owned(),
            special,
        })
    }

    /// The template of a `tokenizer_config.json` (its `chat_template`: a string, or a list of
    /// `{name, template}` from which `default` is taken) with its special tokens. `Ok(None)` when
    /// the config has no template, as base models do.
    pub fn from_tokenizer_config_json(text: &str, origin: &str) -> Result<Option<Self>> {
        let config = parse_config(text, origin)?;
        let special = SpecialTokens::from_config(&config, origin)?;
        template_source(&config, origin)?
            .map(|source| Self::new(&source, origin, special))
            .transpose()
    }

    /// Where the template came from (a path or the name given to [`ChatTemplate::new`]).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The template's Jinja source, as loaded (vLLM's `/tokenizer_info` returns it).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The special tokens the template prints.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// The prompt for `messages`, ending with the assistant header when `add_generation_prompt`.
    /// A template that calls `raise_exception` (bad role order, say) fails with its message.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_kwargs(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`render`](Self::render) with extra template variables, like `chat_template_kwargs` in
    /// vLLM (`{"enable_thinking": false}` for Qwen3). They override `bos_token`/`eos_token` but
    /// not `messages`, `add_generation_prompt` or `tools`.
    pub fn render_with_kwargs(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, Json>,
    ) -> Result<String> {
        let fixed = [
            ("messages", Value::from_serialize(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
        ];
        // Later entries win: special tokens, then the caller's kwargs, then the fixed variables.
        // An absent special token stays undefined (prints nothing), as in `transformers`.
        let special = [
            ("bos_token", &self.special.bos_token),
            ("eos_token", &self.special.eos_token),
        ];
        let ctx: BTreeMap<String, Value> = special
            .into_iter()
            .filter_map(|(key, token)| Some((key.to_owned(), Value::from(token.clone()?))))
            .chain(
                kwargs
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::from_serialize(v))),
            )
            .chain(fixed.map(|(key, value)| (key.to_owned(), value)))
            .collect();
        self.env
            .get_template(&self.origin)
            .and_then(|template| template.render(Value::from(ctx)))
            .map_err(|e| template_error(&self.origin, &e))
    }
}

/// The chat template of a checkpoint directory: `chat_template.jinja` if present (newer
/// `transformers` saves it there), else `chat_template` in `tokenizer_config.json`; special tokens
/// come from `tokenizer_config.json` either way. `Ok(None)` when there is no template at all.
pub fn load_chat_template(dir: &Path) -> Result<Option<ChatTemplate>> {
    let config_path = dir.join("tokenizer_config.json");
    let config_origin = config_path.display().to_string();
    let config = read_optional(&config_path)?
        .map(|text| parse_config(&text, &config_origin))
        .transpose()?;
    let special = match &config {
        Some(config) => SpecialTokens::from_config(config, &config_origin)?,
        None => SpecialTokens::default(),
    };
    let jinja_path = dir.join("chat_template.jinja");
    if let Some(source) = read_optional(&jinja_path)? {
        return ChatTemplate::new(&source, &jinja_path.display().to_string(), special).map(Some);
    }
    let Some(config) = config else {
        return Ok(None);
    };
    template_source(&config, &config_origin)?
        .map(|source| ChatTemplate::new(&source, &config_origin, special))
        .transpose()
}

fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ModelError::Io {
            path: path.into(),
            source,
        }),
    }
}

fn parse_config(text: &str, origin: &str) -> Result<serde_json::Map<String, Json>> {
    match serde_json::from_str(text) {
        Ok(Json::Object(config)) => Ok(config),
        Ok(_) => Err(json_error(origin, "expected a JSON object".into())),
        Err(e) => Err(json_error(origin, e.to_string())),
    }
}

fn template_source(config: &serde_json::Map<String, Json>, origin: &str) -> Result<Option<String>> {
    let entries = match config.get("chat_template") {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::String(source)) => return Ok(Some(source.clone())),
        Some(Json::Array(entries)) => entries,
        Some(_) => {
            return Err(json_error(
                origin,
                "`chat_template` must be a string or a list of {name, template} objects".into(),
            ))
        }
    };
    let mut names = Vec::new();
    for entry in entries {
        let field = |key| entry.get(key).and_then(Json::as_str);
        let (Some(name), Some(source)) = (field("name"), field("template")) else {
            return Err(json_error(
                origin,
                "`chat_template` list entries need string `name` and `template`".into(),
            ));
        };
        if name == "default" {
            return Ok(Some(source.to_owned()));
        }
        names.push(name);
    }
    Err(ModelError::Template {
        origin: origin.to_owned(),
        message: format!("no template named \"default\" among {names:?}"),
    })
}

fn json_error(origin: &str, message: String) -> ModelError {
    ModelError::Json {
        path: origin.into(),
        message,
    }
}

/// `raise_exception` errors carry the template author's message alone, as Jinja2 shows it.
fn template_error(origin: &str, e: &Error) -> ModelError {
    let message = match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(detail)) => detail.to_owned(),
        _ => e.to_string(),
    };
    ModelError::Template {
        origin: origin.to_owned(),
        message,
    }
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(invalid(message))
}

/// A render-time failure; [`template_error`] reports its message verbatim.
fn invalid(message: String) -> Error {
    Error::new(ErrorKind::InvalidOperation, message)
}

/// Hugging Face's `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, which differs from Jinja's own filter (no HTML escaping, spaced separators).
fn tojson(
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<String, Error> {
    // Python accepts a number of spaces or the indent string itself.
    let indent = indent
        .or(kwargs.get::<Option<Value>>("indent")?)
        .filter(|v| !v.is_none() && !v.is_undefined())
        .map(|v| match v.as_str() {
            Some(text) => text.to_owned(),
            None => " ".repeat(
                v.as_i64()
                    .and_then(|n| usize::try_from(n).ok())
                    .unwrap_or(0),
            ),
        });
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => return Err(invalid("tojson: separators must be two strings".into())),
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let formatter = PyJsonFormatter {
        indent,
        item_sep,
        key_sep,
        ensure_ascii,
        depth: 0,
        has_value: false,
    };
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, formatter);
    let serialized = if sort_keys {
        serde_json::to_value(value).and_then(|mut json| {
            json.sort_all_objects();
            json.serialize(&mut serializer)
        })
    } else {
        value.serialize(&mut serializer)
    };
    serialized.map_err(|e| invalid(format!("tojson: {e}")))?;
    String::from_utf8(out).map_err(|e| invalid(e.to_string()))
}

/// Writes JSON the way Python's `json.dumps` lays it out.
struct PyJsonFormatter {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    depth: usize,
    has_value: bool,
}

impl PyJsonFormatter {
    fn open<W: ?Sized + io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        w.write_all(bracket)
    }

    fn close<W: ?Sized + io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(bracket)
    }

    fn item<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(self.item_sep.as_bytes())?;
        }
        self.newline(w)
    }

    fn newline<W: ?Sized + io::Write>(&self, w: &mut W) -> io::Result<()> {
        match &self.indent {
            Some(indent) => write!(w, "\n{}", indent.repeat(self.depth)),
            None => Ok(()),
        }
    }
}

// One line per method: these only route serde_json's layout hooks to the helpers above.
#[rustfmt::skip]
impl serde_json::ser::Formatter for PyJsonFormatter {
    fn begin_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> { self.open(w, b"[") }
    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> { self.close(w, b"]") }
    fn begin_array_value<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> { self.item(w, first) }
    fn end_array_value<W: ?Sized + io::Write>(&mut self, _: &mut W) -> io::Result<()> { self.has_value = true; Ok(()) }
    fn begin_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> { self.open(w, b"{") }
    fn end_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> { self.close(w, b"}") }
    fn begin_object_key<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> { self.item(w, first) }
    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> { w.write_all(self.key_sep.as_bytes()) }
    fn end_object_value<W: ?Sized + io::Write>(&mut self, _: &mut W) -> io::Result<()> { self.has_value = true; Ok(()) }
    fn write_string_fragment<W: ?Sized + io::Write>(&mut self, w: &mut W, s: &str) -> io::Result<()> {
        if !self.ensure_ascii {
            return w.write_all(s.as_bytes());
        }
        for c in s.chars() {
            match c {
                _ if c.is_ascii() => w.write_all(&[c as u8])?,
                _ => for unit in c.encode_utf16(&mut [0; 2]) { write!(w, "\\u{unit:04x}")? },
            }
        }
        Ok(())
    }
}

/// `strftime_now(fmt)`: the current time (UTC) formatted with the common `strftime` directives.
fn strftime_now(format: &str) -> std::result::Result<String, Error> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    format_utc(now.as_secs(), format)
}

fn format_utc(secs: u64, format: &str) -> std::result::Result<String, Error> {
    const MONTHS: &str = "January February March April May June July August September October \
                          November December";
    const DAYS: &str = "Sunday Monday Tuesday Wednesday Thursday Friday Saturday";
    const CUMULATIVE: [u64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let days = secs / 86_400;
    let (hour, minute, second) = (secs % 86_400 / 3600, secs % 3600 / 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm, shifted to March years).
    let z = days + 719_468;
    let (era, doe) = (z / 146_097, z % 146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let yday = CUMULATIVE[(month - 1) as usize] + day + u64::from(leap && month > 2);
    let month_name = MONTHS
        .split(' ')
        .nth((month - 1) as usize)
        .unwrap_or_default();
    let day_name = DAYS
        .split(' ')
        .nth(((days + 4) % 7) as usize)
        .unwrap_or_default();
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let piece = match chars.next() {
            Some('Y') => year.to_string(),
            Some('y') => format!("{:02}", year % 100),
            Some('m') => format!("{month:02}"),
            Some('d') => format!("{day:02}"),
            Some('e') => format!("{day:>2}"),
            Some('j') => format!("{yday:03}"),
            Some('H') => format!("{hour:02}"),
            Some('I') => format!("{hour12:02}"),
            Some('M') => format!("{minute:02}"),
            Some('S') => format!("{second:02}"),
            Some('p') => (if hour < 12 { "AM" } else { "PM" }).to_owned(),
            Some('B') => month_name.to_owned(),
            Some('b') => month_name.chars().take(3).collect(),
            Some('A') => day_name.to_owned(),
            Some('a') => day_name.chars().take(3).collect(),
            Some('%') => "%".to_owned(),
            other => {
                let directive = other.map(String::from).unwrap_or_default();
                return Err(invalid(format!(
                    "strftime_now: unsupported directive %{directive}"
                )));
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::format_utc;

    #[test]
    fn formats_known_instants() {
        // 2023-11-14 22:13:20 UTC, a Tuesday; 2024-03-01 00:00:00 UTC, a Friday of a leap year.
        let fmt = "%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %I%p %e %%";
        assert_eq!(
            format_utc(1_700_000_000, fmt).unwrap(),
            "2023-11-14 22:13:20 Tue Tuesday Nov November 318 23 10PM 14 %"
        );
        assert_eq!(
            format_utc(1_709_251_200, "%d %b %Y %j %a %I%p").unwrap(),
            "01 Mar 2024 061 Fri 12AM"
        );
        assert!(format_utc(0, "%Q").is_err());
    }
}
