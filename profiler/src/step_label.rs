//! The `[LABEL=]` prefix every step flag takes (`--step-symbol`,
//! `--step-python`, `--step-region`): one grammar, one parser, so that a
//! prefix means the same on each flag.
//!
//! - `NAME` (no `=`): label [`DEFAULT_LABEL`], NAME as given;
//! - `LABEL=NAME`: label LABEL (letters, digits, `_`, `.`, `-`), NAME after the first `=`;
//! - `=NAME`: label [`DEFAULT_LABEL`], NAME taken whole, `=` and all: the way to
//!   name something that holds a `=` (`=Vec::operator=`).
//!
//! Anything else (an empty name, a label of other characters) is refused
//! with one line that says what to write. Each flag's spec parser (its clap
//! `value_parser`) takes the prefix off with [`split`] and parses the rest.

/// The label of a step flag that names none.
pub const DEFAULT_LABEL: &str = "train";

/// Why a step flag's text has no usable `[LABEL=]NAME`.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("names nothing: write NAME, LABEL=NAME, or =NAME (label `{DEFAULT_LABEL}`)")]
    EmptyName,
    #[error(
        "'{label}' is not a label (letters, digits, '_', '.', '-' only): write LABEL=NAME, or =NAME to take \
         everything after the first '=' as the name (label `{DEFAULT_LABEL}`)"
    )]
    BadLabel { label: String },
}

/// Splits `text` into (label, name) by the rule above.
pub fn split(text: &str) -> Result<(String, &str), LabelError> {
    let (label, name) = match text.split_once('=') {
        None => (DEFAULT_LABEL, text),
        Some(("", name)) => (DEFAULT_LABEL, name),
        Some((label, _)) if !label.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c)) => {
            return Err(LabelError::BadLabel { label: label.to_owned() });
        }
        Some((label, name)) => (label, name),
    };
    if name.is_empty() {
        return Err(LabelError::EmptyName);
    }
    Ok((label.to_owned(), name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rule_for_the_prefix() {
        assert_eq!(split("train_step"), Ok(("train".into(), "train_step")));
        assert_eq!(split("val=validate"), Ok(("val".into(), "validate")));
        assert_eq!(split("my-label.v2=f"), Ok(("my-label.v2".into(), "f")));
        assert_eq!(split("=f"), Ok(("train".into(), "f")));
        assert_eq!(split("=Vec::operator="), Ok(("train".into(), "Vec::operator=")));
        assert_eq!(split("a=b=c"), Ok(("a".into(), "b=c")));
        assert_eq!(split(""), Err(LabelError::EmptyName));
        assert_eq!(split("val="), Err(LabelError::EmptyName));
        assert_eq!(split("="), Err(LabelError::EmptyName));
        assert_eq!(split("Vec::operator="), Err(LabelError::BadLabel { label: "Vec::operator".into() }));
        assert_eq!(split("my label=f"), Err(LabelError::BadLabel { label: "my label".into() }));
    }

    #[test]
    fn errors_say_what_to_write() {
        let text = split("a b=f").expect_err("bad label").to_string();
        assert!(text.contains("LABEL=NAME") && text.contains("=NAME"), "{text}");
        assert!(!text.contains('\n'), "one line: {text}");
        let text = split("").expect_err("empty").to_string();
        assert!(text.contains("LABEL=NAME"), "{text}");
    }
}
