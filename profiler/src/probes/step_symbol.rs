//! Native steps: finding the step function (`--step-symbol SYMBOL`, searched
//! in the executable, then in the mapped libraries, or `--step-symbol
//! FILE:SYMBOL`) and attaching its entry and return probes.
use std::path::{Path, PathBuf};

use profiler_common::programs;

use crate::step_label;

use super::{
    ProbeError, ProbeSite, Probes,
    elf::{self, FunctionSymbol},
};

/// What the user asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepSymbolSpec {
    /// The steps' label (the `LABEL=` prefix as [`step_label`] reads it).
    pub label: String,
    /// A path (has a `/`) or a file name (`libtrainer.so`) to search alone.
    pub file: Option<String>,
    pub symbol: String,
}

impl StepSymbolSpec {
    /// After the `[LABEL=]` prefix ([`step_label::split`]): `FILE:SYMBOL` when
    /// the part before the first lone `:` names a file (has a `/`, or a `.so`
    /// name); otherwise the whole text is a symbol, so that C++ names like
    /// `Trainer::step` need no quoting. A symbol holding `=` (`operator=`) is
    /// written `=SYMBOL`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (label, s) = step_label::split(s).map_err(|e| format!("--step-symbol '{s}': {e}"))?;
        let bytes = s.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b':' {
                let lone = bytes.get(i + 1) != Some(&b':') && (i == 0 || bytes[i - 1] != b':');
                let file = &s[..i];
                if lone && (file.contains('/') || file.ends_with(".so") || file.contains(".so.")) && i + 1 < s.len() {
                    return Ok(Self { label, file: Some(file.to_owned()), symbol: s[i + 1..].to_owned() });
                }
            }
            i += 1;
        }
        Ok(Self { label, file: None, symbol: s.to_owned() })
    }
}

impl std::fmt::Display for StepSymbolSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.label != step_label::DEFAULT_LABEL || self.symbol.contains('=') {
            write!(f, "{}=", self.label)?;
        }
        match &self.file {
            Some(file) => write!(f, "{file}:{}", self.symbol),
            None => f.write_str(&self.symbol),
        }
    }
}

/// The step function, found.
#[derive(Clone, Debug)]
pub struct ResolvedStep {
    /// The file as the target sees it.
    pub path: PathBuf,
    /// The symbol as stored in the file.
    pub symbol: String,
    pub file_offset: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum StepSymbolError {
    #[error("step symbol '{symbol}' not found in {searched}{near}; name the file with --step-symbol FILE:SYMBOL")]
    NotFound { symbol: String, searched: String, near: String },
    #[error("step symbol '{symbol}' is ambiguous in {path}: {candidates}; pass the mangled name")]
    Ambiguous { symbol: String, path: PathBuf, candidates: String },
    #[error("--step-symbol file '{0}' is neither a readable file nor mapped by the target")]
    NoSuchFile(String),
}

/// Searches `candidates` (target-visible paths, the executable first) for the
/// symbol; `open` maps a target-visible path to bytes (None if unreadable).
pub fn resolve<B: AsRef<[u8]>>(
    spec: &StepSymbolSpec,
    candidates: &[PathBuf],
    mut open: impl FnMut(&Path) -> Option<B>,
) -> Result<ResolvedStep, StepSymbolError> {
    let files: Vec<PathBuf> = match &spec.file {
        None => candidates.to_vec(),
        Some(f) if f.contains('/') => vec![PathBuf::from(f)],
        Some(f) => candidates
            .iter()
            .filter(|c| {
                c.file_name().and_then(|n| n.to_str()).is_some_and(|n| n == f || n.starts_with(&format!("{f}.")))
            })
            .cloned()
            .collect(),
    };
    if files.is_empty() {
        return Err(StepSymbolError::NoSuchFile(spec.file.clone().unwrap_or_default()));
    }
    let mut near: Vec<(String, PathBuf)> = Vec::new();
    let mut readable = 0;
    for path in &files {
        let Some(bytes) = open(path) else { continue };
        let Ok(symbols) = elf::function_symbols(bytes.as_ref()) else {
            continue;
        };
        readable += 1;
        // An exact symbol name wins over demangled matches (`main` is not `app::main`).
        let mut found: Vec<&FunctionSymbol> = symbols.iter().filter(|s| s.name == spec.symbol).collect();
        if found.is_empty() {
            found = symbols.iter().filter(|s| elf::matches(&s.name, &spec.symbol)).collect();
        }
        let mut addrs: Vec<u64> = found.iter().map(|s| s.address).collect();
        addrs.sort_unstable();
        addrs.dedup();
        match (found.first(), addrs.len()) {
            (Some(s), 1) => {
                return Ok(ResolvedStep { path: path.clone(), symbol: s.name.clone(), file_offset: s.file_offset });
            }
            (Some(_), _) => {
                let mut names: Vec<String> = found.iter().map(|s| s.name.clone()).collect();
                names.dedup();
                return Err(StepSymbolError::Ambiguous {
                    symbol: spec.symbol.clone(),
                    path: path.clone(),
                    candidates: names.join(", "),
                });
            }
            (None, _) => {
                for n in elf::near_matches(&spec.symbol, symbols.iter().map(|s| s.name.as_str()), 3) {
                    near.push((n, path.clone()));
                }
            }
        }
    }
    let searched = match (files.first(), files.len()) {
        (Some(f), 1) => f.display().to_string(),
        (Some(f), n) => format!("{} and the {} libraries it maps ({readable} readable)", f.display(), n - 1),
        (None, _) => "nothing".into(),
    };
    near.truncate(5);
    let near = if near.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = near.iter().map(|(n, p)| format!("{n} ({})", p.display())).collect();
        format!("; near matches: {}", list.join(", "))
    };
    Err(StepSymbolError::NotFound { symbol: spec.symbol.clone(), searched, near })
}

impl Probes {
    /// Entry and return probes on the step function.
    pub fn attach_step(&mut self, path: &Path, file_offset: u64, probe_id: u32) -> Result<(), ProbeError> {
        let cookie = probe_id.into();
        self.attach_sites(
            path,
            &[
                ProbeSite::new(programs::STEP_ENTER, file_offset, cookie),
                ProbeSite::new(programs::STEP_EXIT, file_offset, cookie),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_file_and_symbol_forms() {
        let parse = |s: &str| StepSymbolSpec::parse(s).expect(s);
        let t = |file: Option<&str>, symbol: &str| StepSymbolSpec {
            label: "train".into(),
            file: file.map(String::from),
            symbol: symbol.into(),
        };
        assert_eq!(parse("train_step"), t(None, "train_step"));
        assert_eq!(
            parse("eval=/opt/lib.so:validate"),
            StepSymbolSpec { label: "eval".into(), file: Some("/opt/lib.so".into()), symbol: "validate".into() }
        );
        assert_eq!(parse("eval=/opt/lib.so:validate").to_string(), "eval=/opt/lib.so:validate");
        assert_eq!(parse("=operator=").symbol, "operator=", "= first: the rest is the name");
        assert_eq!(parse("=operator=").to_string(), "train=operator=", "shown as it re-parses");
        assert!(StepSymbolSpec::parse("operator=").is_err(), "a label with nothing after it");
        assert!(StepSymbolSpec::parse("Vec::operator=").is_err(), "not a label");
        assert_eq!(parse("/opt/bin/trainer:train_step"), t(Some("/opt/bin/trainer"), "train_step"));
        assert_eq!(parse("libtrainer.so:step"), t(Some("libtrainer.so"), "step"));
        assert_eq!(parse("Trainer::step"), t(None, "Trainer::step"));
        assert_eq!(parse("./a.out:ns::Trainer::step"), t(Some("./a.out"), "ns::Trainer::step"));
    }

    #[test]
    fn resolves_in_own_test_binary_and_reports_near_matches() {
        let parse = |s: &str| StepSymbolSpec::parse(s).expect(s);
        let exe = std::env::current_exe().expect("exe");
        let bytes = std::fs::read(&exe).expect("read");
        let cands = vec![exe.clone()];
        let ok = resolve(&parse("main"), &cands, |_| Some(bytes.as_slice())).expect("main exists");
        assert_eq!(ok.symbol, "main");
        assert_eq!(ok.path, exe);
        let err = resolve(&parse("mainn"), &cands, |_| Some(bytes.as_slice())).expect_err("typo");
        let msg = err.to_string();
        assert!(msg.contains("not found") && msg.contains("near matches: main"), "{msg}");
    }

    #[test]
    fn file_name_filter_with_no_match_is_an_error() {
        let parse = |s: &str| StepSymbolSpec::parse(s).expect(s);
        let cands = vec![PathBuf::from("/usr/bin/trainer")];
        let err = resolve(&parse("libx.so:step"), &cands, |_| None::<Vec<u8>>).expect_err("no file");
        assert!(matches!(err, StepSymbolError::NoSuchFile(_)));
    }
}
