//! `--step-python [LABEL=][FILE_SUFFIX:]NAME`: what a Python step function
//! spec says, checked against what the kernel-side filter can match, and the
//! filter entry (`PY_TARGETS`) it becomes. Both routes (USDT, frame hook) take it.
use std::fmt;

use profiler_common::{PY_NAME_CAP, PyTarget};

use crate::step_label;

/// `--step-python [LABEL=][FILE_SUFFIX:]NAME` (the prefix as [`step_label`] reads it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PythonStepSpec {
    /// What the steps are called (`steps.label`), e.g. `train`, `val`.
    pub label: String,
    /// What the code object's file name must end with, at a `/` boundary.
    pub file_suffix: Option<String>,
    /// The function's bare name, as CPython's probes report it (`co_name`).
    pub function: String,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PythonSpecError {
    #[error("--step-python '{0}': {1}")]
    Label(String, step_label::LabelError),
    #[error("--step-python '{0}': no function name")]
    Empty(String),
    #[error(
        "--step-python '{spec}': CPython's probes report the bare function name (co_name), not '{name}'; \
         pass '{short}', with FILE_SUFFIX:{short} to tell apart functions of that name"
    )]
    Qualified { spec: String, name: String, short: String },
    #[error("--step-python '{spec}': '{what}' is {len} bytes, the kernel-side filter holds at most {PY_NAME_CAP}")]
    TooLong { spec: String, what: String, len: usize },
    #[error("--step-python '{0}': not a Python identifier")]
    NotIdentifier(String),
}

impl PythonStepSpec {
    pub fn parse(spec: &str) -> Result<Self, PythonSpecError> {
        let (label, rest) = step_label::split(spec).map_err(|e| PythonSpecError::Label(spec.to_owned(), e))?;
        let (file_suffix, function) = match rest.rsplit_once(':') {
            Some((f, n)) if !f.is_empty() => (Some(f.to_owned()), n),
            Some((_, n)) => (None, n),
            None => (None, rest),
        };
        if function.is_empty() {
            return Err(PythonSpecError::Empty(spec.to_owned()));
        }
        if let Some((_, short)) = function.rsplit_once('.') {
            return Err(PythonSpecError::Qualified {
                spec: spec.to_owned(),
                name: function.to_owned(),
                short: short.to_owned(),
            });
        }
        // Identifiers may be non-ASCII; the probe reports them as UTF-8.
        let first_ok = function.chars().next().is_some_and(|c| c == '_' || c.is_alphabetic());
        if !first_ok || !function.chars().all(|c| c == '_' || c.is_alphanumeric()) {
            // `<module>`, `<lambda>`, `<listcomp>` are code names CPython reports too.
            if !(function.starts_with('<') && function.ends_with('>')) {
                return Err(PythonSpecError::NotIdentifier(spec.to_owned()));
            }
        }
        for (what, len) in [
            (function, function.len()),
            (file_suffix.as_deref().unwrap_or(""), file_suffix.as_ref().map_or(0, String::len)),
        ] {
            if len > PY_NAME_CAP {
                return Err(PythonSpecError::TooLong { spec: spec.to_owned(), what: what.to_owned(), len });
            }
        }
        Ok(Self { label, file_suffix, function: function.to_owned() })
    }

    /// The `PY_TARGETS` entry; `label_id` is what the kernel writes to
    /// `OrderedRecord::probe` when this function enters or returns.
    pub fn target(&self, label_id: u32) -> PyTarget {
        let mut t = PyTarget { label_id, ..Default::default() };
        let name = self.function.as_bytes();
        t.name[..name.len()].copy_from_slice(name);
        t.name_len = name.len() as u32;
        if let Some(s) = &self.file_suffix {
            t.file_suffix[..s.len()].copy_from_slice(s.as_bytes());
            t.suffix_len = s.len() as u32;
        }
        t
    }
}

impl fmt::Display for PythonStepSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}=", self.label)?;
        if let Some(s) = &self.file_suffix {
            write!(f, "{s}:")?;
        }
        f.write_str(&self.function)
    }
}

/// A Python step function to attach, and the id its records carry.
#[derive(Clone, Debug)]
pub struct PythonTarget {
    pub spec: PythonStepSpec,
    /// Written to `OrderedRecord::probe`; the caller maps it back to `spec.label`.
    pub label_id: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(label: &str, suffix: Option<&str>, function: &str) -> PythonStepSpec {
        PythonStepSpec { label: label.into(), file_suffix: suffix.map(Into::into), function: function.into() }
    }

    #[test]
    fn parses_label_file_suffix_and_name() {
        assert_eq!(PythonStepSpec::parse("train_step"), Ok(spec("train", None, "train_step")));
        assert_eq!(PythonStepSpec::parse("val=validate"), Ok(spec("val", None, "validate")));
        assert_eq!(PythonStepSpec::parse("train.py:train_step"), Ok(spec("train", Some("train.py"), "train_step")));
        assert_eq!(
            PythonStepSpec::parse("inner=lib/helper.py:train_step"),
            Ok(spec("inner", Some("lib/helper.py"), "train_step"))
        );
        assert_eq!(PythonStepSpec::parse(":f"), Ok(spec("train", None, "f")));
        assert_eq!(PythonStepSpec::parse("<lambda>"), Ok(spec("train", None, "<lambda>")));
        assert_eq!(PythonStepSpec::parse("étape"), Ok(spec("train", None, "étape")));
    }

    #[test]
    fn rejects_what_the_probe_cannot_match_with_a_way_out() {
        assert!(matches!(PythonStepSpec::parse(""), Err(PythonSpecError::Label(..))));
        assert_eq!(PythonStepSpec::parse("x.py:"), Err(PythonSpecError::Empty("x.py:".into())));
        assert_eq!(PythonStepSpec::parse("=f"), Ok(spec("train", None, "f")));
        assert!(matches!(PythonStepSpec::parse("a b=f"), Err(PythonSpecError::Label(..))));
        let e = PythonStepSpec::parse("Trainer.train_step").expect_err("qualified");
        assert!(e.to_string().contains("pass 'train_step'"), "{e}");
        assert!(matches!(PythonStepSpec::parse("train-step"), Err(PythonSpecError::NotIdentifier(_))));
        let long = "f".repeat(PY_NAME_CAP + 1);
        assert!(matches!(PythonStepSpec::parse(&long), Err(PythonSpecError::TooLong { len: 65, .. })));
        assert!(PythonStepSpec::parse(&"f".repeat(PY_NAME_CAP)).is_ok());
    }

    #[test]
    fn targets_are_zero_padded_for_the_word_compare() {
        let t = spec("val", Some("eval.py"), "validate").target(7);
        assert_eq!(&t.name[..8], b"validate");
        assert!(t.name[8..].iter().all(|&b| b == 0));
        assert_eq!((t.name_len, t.suffix_len, t.label_id), (8, 7, 7));
        assert_eq!(&t.file_suffix[..7], b"eval.py");
        assert!(t.file_suffix[7..].iter().all(|&b| b == 0));
    }
}
