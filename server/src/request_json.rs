//! Reading a request's raw JSON: the body into its typed request struct, and the fields serde
//! cannot check by type alone (`stop`'s two forms, integer ranges, `logit_bias` keys, the
//! `model` name), each failure an [`ApiError`] naming the field at fault (`param`).

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::api_error::ApiError;

/// Parses a JSON body into `T`, naming the field at fault: syntax errors give no `param`, a
/// wrong type gives its path (`temperature`, `messages[0].content`), a missing field its name.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some_and(|&b| b != b'{') {
        // serde would accept a struct written as an array; OpenAI bodies are objects.
        serde_json::from_slice::<serde::de::IgnoredAny>(body).map_err(|e| json_error(".", &e))?;
        return Err(ApiError::InvalidRequest {
            message: "the request body must be a JSON object".into(),
            param: None,
            code: Some("invalid_type"),
        });
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(&mut de);
    let value = match parsed {
        Ok(value) => value,
        Err(err) => {
            let path = err.path().to_string();
            let inner = err.into_inner();
            return Err(json_error(&path, &inner));
        }
    };
    de.end().map_err(|e| json_error(".", &e))?;
    Ok(value)
}

fn json_error(path: &str, err: &serde_json::Error) -> ApiError {
    use serde_json::error::Category;
    match err.classify() {
        Category::Syntax | Category::Eof | Category::Io => ApiError::InvalidRequest {
            message: format!("the request body is not valid JSON: {err}"),
            param: None,
            code: Some("invalid_json"),
        },
        Category::Data => {
            let text = err.to_string();
            // serde reports a missing field at the enclosing object's path.
            let missing = text
                .strip_prefix("missing field `")
                .and_then(|rest| rest.split('`').next());
            let param = match (missing, path) {
                (Some(field), "." | "") => Some(field.to_string()),
                (Some(field), parent) => Some(format!("{parent}.{field}")),
                (None, "." | "") => None,
                (None, path) => Some(path.to_string()),
            };
            let message = match &param {
                Some(p) if missing.is_none() => format!("invalid `{p}`: {text}"),
                _ => text,
            };
            ApiError::InvalidRequest {
                message,
                param,
                code: Some("invalid_type"),
            }
        }
    }
}

/// `stop`: a string, an array of strings, or null.
pub fn stop_strings(value: Option<&Value>) -> Result<Vec<String>, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s.clone()),
                _ => Err(ApiError::invalid(
                    format!("stop[{i}]"),
                    "stop must be a string or an array of strings",
                )),
            })
            .collect(),
        Some(_) => Err(ApiError::invalid(
            "stop",
            "stop must be a string or an array of strings",
        )),
    }
}

/// An integer field that must lie in `[min, max]`.
pub fn int_in(param: &str, value: i64, min: i64, max: i64) -> Result<i64, ApiError> {
    if (min..=max).contains(&value) {
        Ok(value)
    } else if max == i64::MAX {
        Err(ApiError::invalid(
            param,
            format!("`{param}` must be at least {min}, got {value}"),
        ))
    } else {
        Err(ApiError::invalid(
            param,
            format!("`{param}` must be in [{min}, {max}], got {value}"),
        ))
    }
}

/// `logit_bias`: token ids (as strings, the JSON object's keys) to numbers. Ranges and ids
/// beyond the vocabulary are checked with the other sampling parameters.
pub fn logit_bias(map: &Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    map.iter()
        .map(|(key, value)| {
            let token = key.trim().parse::<u32>().map_err(|_| {
                ApiError::invalid(
                    format!("logit_bias.{key}"),
                    format!("`logit_bias` keys must be token ids, got `{key}`"),
                )
            })?;
            let bias = value.as_f64().ok_or_else(|| {
                ApiError::invalid(
                    format!("logit_bias.{key}"),
                    format!("`logit_bias` values must be numbers, got {value}"),
                )
            })?;
            Ok((token, bias as f32))
        })
        .collect()
}

/// The requested model must be the served one (an absent `model` means the served one).
pub fn check_model(requested: Option<&str>, served: &str) -> Result<(), ApiError> {
    match requested {
        None => Ok(()),
        // A directory given as `--model DIR/` is served as `DIR`; clients may still send it
        // the way it was typed.
        Some(name) if name == served || name.trim_end_matches('/') == served => Ok(()),
        Some(name) => Err(ApiError::ModelNotFound(name.chars().take(256).collect())),
    }
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Probe {
        a: f64,
        #[serde(default)]
        b: Option<Vec<Inner>>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        c: String,
    }

    #[test]
    fn json_errors_name_the_field() {
        let err = parse_json::<Probe>(br#"{"a": "x"}"#).unwrap_err();
        assert_eq!(err.param(), Some("a"));
        let err = parse_json::<Probe>(br#"{"a": 1, "b": [{"c": 3}]}"#).unwrap_err();
        assert_eq!(err.param(), Some("b[0].c"));
        let err = parse_json::<Probe>(br#"{}"#).unwrap_err();
        assert_eq!(err.param(), Some("a"));
        let err = parse_json::<Probe>(br#"{"a": 1, "b": [{}]}"#).unwrap_err();
        assert_eq!(err.param(), Some("b[0].c"));
        let err = parse_json::<Probe>(br#"{"a": "#).unwrap_err();
        assert_eq!(err.param(), None);
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        let err = parse_json::<Probe>(br#"{"a": 1} x"#).unwrap_err();
        assert_eq!(err.code(), Some("invalid_json"));
        assert!(parse_json::<Probe>(br#"{"a": 1, "zzz": 2}"#).is_ok());
    }

    #[test]
    fn stop_forms() {
        use serde_json::json;
        assert_eq!(stop_strings(None).unwrap(), Vec::<String>::new());
        assert_eq!(
            stop_strings(Some(&json!("x"))).unwrap(),
            vec!["x".to_string()]
        );
        assert_eq!(stop_strings(Some(&json!(["a", "b"]))).unwrap().len(), 2);
        assert_eq!(
            stop_strings(Some(&json!(["a", 1]))).unwrap_err().param(),
            Some("stop[1]")
        );
        assert_eq!(
            stop_strings(Some(&json!(3))).unwrap_err().param(),
            Some("stop")
        );
    }

    #[test]
    fn a_model_named_as_typed_with_a_trailing_slash_is_the_served_one() {
        assert!(check_model(None, "models/q3").is_ok());
        assert!(check_model(Some("models/q3"), "models/q3").is_ok());
        assert!(check_model(Some("models/q3/"), "models/q3").is_ok());
        assert!(check_model(Some("models/q3//"), "models/q3").is_ok());
        let err = check_model(Some("models/q"), "models/q3").unwrap_err();
        assert_eq!(err.code(), Some("model_not_found"));
        assert!(check_model(Some("/"), "models/q3").is_err());
    }
}
