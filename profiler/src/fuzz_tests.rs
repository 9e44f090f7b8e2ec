//! Property-based fuzzing of the parsers that read what the target hands us: the ELF symbol reader
//! (`probes::elf`), the USDT note and argument-spec parser (`probes::usdt`), the probe-placement decoder
//! (`probes::placement`) and the ring-buffer record decoder (`events`).
//!
//! Each property feeds a parser arbitrary bytes and, more usefully, *structure-aware* mutations of real inputs
//! (field-aligned writes of boundary values into the ELF header, program and section headers, note and symbol
//! sections; byte flips; truncations), and asserts that it does not panic and that what it returns comes from the
//! bytes: a symbol's file offset is its address through a `PT_LOAD` header read here independently, a USDT note's
//! descriptor is found in the file's note bytes, a probe point is an instruction boundary reached by side-effect-free
//! instructions, a record's fields are the bytes at their offsets.
//!
//! Seeds: the small files in `tests/corpus/` (committed; cut from Debian's `python3.11`, `libc.so.6` and
//! `libstdc++.so.6` by `regenerate_corpus` below), hand-built ELF files, and the full system libraries when the
//! machine has them (said once on stderr when it does not).
//!
//! Case counts: proptest's default (256, or `PROPTEST_CASES`) per property in a plain `cargo test`, scaled down for
//! the properties that parse megabyte files; `PROFILER_FUZZ_CASES=N` sets the count (same scaling) for a long run:
//!
//! ```text
//! PROFILER_FUZZ_CASES=100000 cargo test --release -p profiler fuzz_ -- --test-threads=2
//! ```
//!
//! On a 2-core VM: all properties together take ≈0.3 s at the default count and ≈40 s at 100 000 (release). A debug
//! build (`cargo test -p profiler fuzz_`) adds overflow checks, at about 30 times the cost. Plain stable `cargo test`:
//! no cargo-fuzz, no nightly.
//!
//! A failure is shrunk and its seed saved under `profiler/proptest-regressions/fuzz_tests.txt` (commit it: proptest
//! replays those first); the shrunk input also becomes a named regression test at the end of this file.

use std::{
    ops::Range,
    path::{Path, PathBuf},
    sync::LazyLock,
};

use iced_x86::{Decoder, DecoderOptions, FlowControl, Instruction};
use object::{Object, ObjectSection, ObjectSegment};
use profiler_common::{KernelNameRecord, LaunchApi, LaunchRecord, OrderedRecord, RecordHeader, RecordKind};
use proptest::{prelude::*, sample::Index, test_runner::TestCaseError};

use crate::{
    events::{self, Event},
    probes::{
        elf,
        placement::{self, Placement, PlacementReason},
        python,
        usdt::{self, ArgLocation, ArgSpecError, UsdtArg},
    },
};

// ---------------------------------------------------------------------------------------------------------------
// Configuration

/// The case count: `PROFILER_FUZZ_CASES` when set, else proptest's default (256, or `PROPTEST_CASES`); divided by
/// `weight` for the properties whose single case costs milliseconds (whole-library parses), at least 16.
fn config(weight: u32) -> ProptestConfig {
    let base = ProptestConfig::default();
    let cases = std::env::var("PROFILER_FUZZ_CASES").ok().and_then(|v| v.parse::<u32>().ok()).unwrap_or(base.cases);
    ProptestConfig { cases: (cases / weight).max(16), max_shrink_iters: 2048, ..base }
}

// ---------------------------------------------------------------------------------------------------------------
// Seeds

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus")
}

/// Committed seeds (see `regenerate_corpus`).
const PYTHON_USDT_ELF: &[u8] = include_bytes!("../tests/corpus/python3.11-usdt.elf");
const LIBC_SYMBOLS_ELF: &[u8] = include_bytes!("../tests/corpus/libc-symbols.elf");
/// 64-byte windows at function entries of libc and python3.11 (`placement::WINDOW` each).
const ENTRY_WINDOWS: &[u8] = include_bytes!("../tests/corpus/entries.bin");
/// USDT argument strings, one a line.
const USDT_ARGS: &str = include_str!("../tests/corpus/usdt-args.txt");
/// Mangled C++ and Rust symbol names, one a line.
const MANGLED_NAMES: &str = include_str!("../tests/corpus/mangled-names.txt");

const SYSTEM_LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";
const SYSTEM_PYTHON: &str = "/usr/bin/python3.11";

/// An ELF seed and the byte ranges worth mutating.
struct Seed {
    name: String,
    bytes: Vec<u8>,
    regions: Vec<Range<usize>>,
}

/// Its name only: a failing case prints the seed, and some are megabytes.
impl std::fmt::Debug for Seed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

impl Seed {
    fn new(name: impl Into<String>, bytes: Vec<u8>) -> Self {
        let regions = regions(&bytes);
        Self { name: name.into(), bytes, regions }
    }
}

/// A system file, or None with one line on stderr (the fuzzing still runs on the committed corpus).
fn system_file(path: &str) -> Option<Vec<u8>> {
    match std::fs::read(path) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("fuzz: {path} not readable ({e}): seeds from tests/corpus only");
            None
        }
    }
}

/// ELF seeds with symbols: the committed cut of libc, a hand-built file, and the whole libc when present.
static SYMBOL_SEEDS: LazyLock<Vec<Seed>> = LazyLock::new(|| {
    let mut seeds = vec![
        Seed::new("corpus/libc-symbols.elf", LIBC_SYMBOLS_ELF.to_vec()),
        Seed::new("built/symbols", built_symbols_elf()),
    ];
    seeds.extend(system_file(SYSTEM_LIBC).map(|b| Seed::new(SYSTEM_LIBC, b)));
    seeds
});

/// ELF seeds with `.note.stapsdt`: the committed cut of python3.11, a hand-built file with every argument form, and
/// the whole python3.11 when present.
static NOTE_SEEDS: LazyLock<Vec<Seed>> = LazyLock::new(|| {
    let mut seeds = vec![
        Seed::new("corpus/python3.11-usdt.elf", PYTHON_USDT_ELF.to_vec()),
        Seed::new("built/usdt", built_usdt_elf()),
    ];
    seeds.extend(system_file(SYSTEM_PYTHON).map(|b| Seed::new(SYSTEM_PYTHON, b)));
    seeds
});

fn entry_windows() -> Vec<&'static [u8]> {
    ENTRY_WINDOWS.chunks(placement::WINDOW).collect()
}

fn lines(text: &'static str) -> Vec<&'static str> {
    text.lines().filter(|l| !l.is_empty()).collect()
}

// ---------------------------------------------------------------------------------------------------------------
// Reading ELF64 little-endian headers here, independently of `object`: the ground truth the invariants compare with.

fn u16_at(d: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(d.get(at..at.checked_add(2)?)?.try_into().ok()?))
}
fn u32_at(d: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(d.get(at..at.checked_add(4)?)?.try_into().ok()?))
}
fn u64_at(d: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(d.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

fn is_elf64_le(d: &[u8]) -> bool {
    d.get(..6) == Some(&[0x7f, b'E', b'L', b'F', 2, 1][..])
}

/// A `PT_LOAD` program header.
#[derive(Clone, Copy, Debug)]
struct Load {
    flags: u32,
    offset: u64,
    vaddr: u64,
    memsz: u64,
}

impl Load {
    /// The file offset of `address` through this segment (no wrapping).
    fn offset_of(&self, address: u64) -> Option<u64> {
        let delta = address.checked_sub(self.vaddr).filter(|&d| d < self.memsz)?;
        self.offset.checked_add(delta)
    }
}

/// The `PT_LOAD` headers of an ELF64 LE file; None when this reader cannot tell (extended numbering, bad table).
fn loads(d: &[u8]) -> Option<Vec<Load>> {
    if !is_elf64_le(d) {
        return None;
    }
    let phoff = usize::try_from(u64_at(d, 0x20)?).ok()?;
    let phentsize = usize::from(u16_at(d, 0x36)?);
    let phnum = usize::from(u16_at(d, 0x38)?);
    if phnum == 0xffff || phentsize < 56 {
        return None;
    }
    let mut out = Vec::new();
    for i in 0..phnum {
        let at = phoff.checked_add(i.checked_mul(phentsize)?)?;
        let field = |plus: usize| at.saturating_add(plus);
        if u32_at(d, at)? == 1 {
            out.push(Load {
                flags: u32_at(d, field(4))?,
                offset: u64_at(d, field(8))?,
                vaddr: u64_at(d, field(16))?,
                memsz: u64_at(d, field(40))?,
            });
        }
    }
    Some(out)
}

/// Byte ranges of an ELF64 file a mutation should hit: the ELF header, the program and section header tables, and
/// the first 4 KiB of every section that has file bytes; the whole file last.
fn regions(d: &[u8]) -> Vec<Range<usize>> {
    let clamp = |start: u64, len: u64| -> Option<Range<usize>> {
        let start = usize::try_from(start).ok()?;
        let end = start.saturating_add(usize::try_from(len).ok()?).min(d.len());
        (start < end).then_some(start..end)
    };
    // The ELF header first.
    let mut out: Vec<Range<usize>> = Vec::new();
    out.push(0..d.len().min(64));
    if is_elf64_le(d) {
        let table = |off, entsize, num| {
            Some(clamp(u64_at(d, off)?, u64::from(u16_at(d, entsize)?) * u64::from(u16_at(d, num)?)))
        };
        out.extend(table(0x20, 0x36, 0x38).flatten());
        out.extend(table(0x28, 0x3a, 0x3c).flatten());
        if let (Some(shoff), Some(shnum)) = (u64_at(d, 0x28), u16_at(d, 0x3c)) {
            for i in 0..u64::from(shnum) {
                let at = usize::try_from(shoff.saturating_add(i * 64)).unwrap_or(usize::MAX);
                let field = |plus: usize| at.saturating_add(plus);
                let (Some(kind), Some(off), Some(size)) =
                    (u32_at(d, field(4)), u64_at(d, field(0x18)), u64_at(d, field(0x20)))
                else {
                    continue;
                };
                if kind != 8 {
                    out.extend(clamp(off, size.min(4096)));
                }
            }
        }
    }
    out.retain(|r| !r.is_empty());
    // Never empty, even for an empty file: proptest's `Index` needs a non-empty range to pick from.
    out.push(0..d.len());
    out
}

// ---------------------------------------------------------------------------------------------------------------
// Mutations

/// A value to write: a fixed one, or one relative to the file's length (offsets and sizes that end just inside or
/// just outside the file are where bounds checks go wrong).
#[derive(Clone, Copy, Debug)]
enum Value {
    Fixed(u64),
    FileLen(i16),
}

#[derive(Clone, Debug)]
enum Mutation {
    /// Write the low `width` bytes of `value` at a place in region `region` (aligned to `width` when `aligned`:
    /// ELF fields are naturally aligned).
    Write { region: Index, at: Index, width: u8, value: Value, aligned: bool },
    /// Flip one bit.
    Flip { region: Index, at: Index, bit: u8 },
    /// Cut the file at a place in a region.
    Truncate { region: Index, at: Index },
}

fn interesting_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(3),
        Just(7),
        Just(8),
        Just(0x7f),
        Just(0x80),
        Just(0xff),
        Just(0x7fff),
        Just(0xffff),
        Just(0x7fff_ffff),
        Just(0x8000_0000),
        Just(0xffff_ffff),
        Just(0x1_0000_0000),
        Just(i64::MAX as u64),
        Just(i64::MIN as u64),
        Just(u64::MAX),
        Just(u64::MAX - 7),
        0u64..0x100,
        any::<u64>(),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![4 => interesting_u64().prop_map(Value::Fixed), 1 => (-64i16..64).prop_map(Value::FileLen)]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        8 => (any::<Index>(), any::<Index>(), prop::sample::select(vec![1u8, 2, 4, 8]), value(), any::<bool>())
            .prop_map(|(region, at, width, value, aligned)| Mutation::Write { region, at, width, value, aligned }),
        3 => (any::<Index>(), any::<Index>(), 0u8..8).prop_map(|(region, at, bit)| Mutation::Flip { region, at, bit }),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(region, at)| Mutation::Truncate { region, at }),
    ]
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    prop::collection::vec(mutation(), 0..8)
}

/// The seed with the mutations applied in order (regions are the seed's; places past a truncation are skipped).
fn mutate(seed: &Seed, mutations: &[Mutation]) -> Vec<u8> {
    let mut d = seed.bytes.clone();
    for m in mutations {
        let place = |region: &Index, at: &Index| {
            let r = &seed.regions[region.index(seed.regions.len())];
            if r.is_empty() { r.start } else { r.start + at.index(r.len()) }
        };
        match m {
            Mutation::Write { region, at, width, value, aligned } => {
                let width = usize::from(*width);
                let mut at = place(region, at);
                if *aligned {
                    at -= at % width;
                }
                let v = match *value {
                    Value::Fixed(v) => v,
                    Value::FileLen(delta) => (d.len() as u64).wrapping_add_signed(i64::from(delta)),
                };
                let end = (at + width).min(d.len());
                if at < end {
                    d[at..end].copy_from_slice(&v.to_le_bytes()[..end - at]);
                }
            }
            Mutation::Flip { region, at, bit } => {
                if let Some(b) = d.get_mut(place(region, at)) {
                    *b ^= 1 << bit;
                }
            }
            Mutation::Truncate { region, at } => {
                let at = place(region, at);
                d.truncate(at);
            }
        }
    }
    d
}

fn seed_and_mutations(seeds: &'static [Seed]) -> impl Strategy<Value = (&'static Seed, Vec<Mutation>)> {
    (prop::sample::select(seeds.iter().collect::<Vec<&Seed>>()), mutations())
}

/// Bytes, mostly near `sizes` long (off by a little either way), sometimes any length up to `max`.
fn bytes_near(sizes: Vec<usize>, max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => (prop::sample::select(sizes), -9isize..10)
            .prop_flat_map(|(s, d)| prop::collection::vec(any::<u8>(), s.saturating_add_signed(d))),
        1 => prop::collection::vec(any::<u8>(), 0..max),
    ]
}

// ---------------------------------------------------------------------------------------------------------------
// ELF symbol reader

/// What `function_symbols` returns is sorted, deduplicated, unversioned, defined, and at the file offset that a
/// `PT_LOAD` header read here maps the symbol's address to.
fn check_symbols(d: &[u8]) -> Result<(), TestCaseError> {
    let Ok(symbols) = elf::function_symbols(d) else { return Ok(()) };
    for pair in symbols.windows(2) {
        let key = |s: &elf::FunctionSymbol| (s.name.clone(), s.address);
        prop_assert!(key(&pair[0]) < key(&pair[1]), "not sorted or not deduplicated: {:?}", pair);
    }
    let loads = loads(d);
    for s in &symbols {
        prop_assert!(!s.name.contains('@'), "{s:?} keeps its version");
        prop_assert_ne!(s.address, 0);
        if let Some(loads) = &loads {
            prop_assert!(
                loads.iter().any(|l| l.offset_of(s.address) == Some(s.file_offset)),
                "{s:?}: no PT_LOAD maps the address to the offset ({loads:?})"
            );
        }
    }
    // The consumers of the list: matching by name must not panic either.
    if let Some(s) = symbols.first() {
        prop_assert!(elf::matches(&s.name, &s.name));
        let _ = elf::near_matches(&s.name, symbols.iter().take(64).map(|s| s.name.as_str()), 3);
    }
    let _ = elf::interpreter(d);
    Ok(())
}

proptest! {
    #![proptest_config(config(4))]

    #[test]
    fn fuzz_elf_symbols_of_mutated_files((seed, muts) in seed_and_mutations(&SYMBOL_SEEDS)) {
        let d = mutate(seed, &muts);
        check_symbols(&d).map_err(|e| TestCaseError::fail(format!("{}: {e}", seed.name)))?;
    }
}

proptest! {
    #![proptest_config(config(1))]

    #[test]
    fn fuzz_elf_symbols_of_arbitrary_bytes(mut d in bytes_near(vec![64, 128, 512], 2048), class in 1u8..=2, ident in any::<bool>()) {
        // Half of the inputs get a valid ident, so the header and table checks are reached.
        if ident && d.len() >= 6 {
            d[..6].copy_from_slice(&[0x7f, b'E', b'L', b'F', class, 1]);
        }
        check_symbols(&d)?;
    }

    #[test]
    fn fuzz_demangling_does_not_panic(name in prop_oneof![
        ".{0,64}",
        "_Z[A-Za-z0-9_]{0,64}",
        "_ZN[0-9a-zA-Z_]{0,64}E",
        (prop::sample::select(lines(MANGLED_NAMES)), any::<Index>(), "[A-Za-z0-9_]{0,4}", 0usize..8)
            .prop_map(|(name, at, insert, cut)| {
                // A real name with a few bytes inserted and a few removed, on char boundaries.
                let mut s = name.to_owned();
                let at = (0..=s.len()).filter(|&i| s.is_char_boundary(i)).nth(at.index(s.len() + 1)).unwrap_or(0);
                s.insert_str(at, &insert);
                let end = (at + cut).min(s.len());
                if s.is_char_boundary(end) { s.replace_range(at..end, ""); }
                s
            }),
        // Deep nesting: pointer chains and template argument lists.
        (1usize..400).prop_map(|n| format!("_Z1f{}i", "P".repeat(n))),
        (1usize..150).prop_map(|n| format!("_Z1fI{}E", "1aI".repeat(n))),
        (1usize..150).prop_map(|n| format!("_ZN{}E", "1a".repeat(n))),
    ]) {
        let short = elf::demangled(&name);
        let full = elf::demangled_full(&name);
        // Only mangled names change: C and Python names are shown as they are.
        if !name.starts_with(['_', 'Z']) {
            prop_assert_eq!(&short, &name);
            prop_assert_eq!(full, None);
        }
        let _ = elf::near_matches(&short, [name.as_str(), "main", "train_step"].into_iter(), 3);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// USDT notes

/// Every note `parse_notes` returns is in the file: its descriptor (the three addresses and three strings) is in a
/// note section's bytes, its addresses are those plus one prelink delta, and its offsets are through an executable
/// (probe) and a non-executable (semaphore) `PT_LOAD` header. The arguments are the string's tokens.
fn check_notes(d: &[u8]) -> Result<(), TestCaseError> {
    let Ok(probes) = usdt::parse_notes(d) else { return Ok(()) };
    let file =
        object::File::parse(d).map_err(|e| TestCaseError::fail(format!("notes from an unparsable file: {e}")))?;
    let elf64_le = matches!(file, object::File::Elf64(_)) && file.is_little_endian() && is_elf64_le(d);
    let note_bytes: Vec<&[u8]> = file
        .sections()
        .filter(|s| s.kind() == object::SectionKind::Note || s.name() == Ok(".note.stapsdt"))
        .filter_map(|s| {
            let (off, size) = s.file_range()?;
            d.get(usize::try_from(off).ok()?..usize::try_from(off.checked_add(size)?).ok()?)
        })
        .collect();
    let base_now = file.section_by_name(".stapsdt.base").map(|s| s.address());
    let loads = loads(d);
    for p in &probes {
        prop_assert!(!p.provider.is_empty() && !p.name.is_empty(), "{p:?}");
        prop_assert_eq!(p.semaphore.is_some(), p.semaphore_file_offset.is_some());
        let delta = match base_now {
            Some(now) if p.note_base != 0 => now.wrapping_sub(p.note_base),
            _ => 0,
        };
        if let Some(loads) = &loads {
            let exec = |l: &&Load| l.flags & 1 != 0;
            prop_assert!(
                loads.iter().filter(exec).any(|l| l.offset_of(p.address) == Some(p.file_offset)),
                "{p:?}: no executable PT_LOAD maps the probe address to its offset ({loads:?})"
            );
            if let (Some(a), Some(off)) = (p.semaphore, p.semaphore_file_offset) {
                prop_assert!(
                    loads.iter().filter(|l| !exec(l)).any(|l| l.offset_of(a) == Some(off)),
                    "{p:?}: no data PT_LOAD maps the semaphore to its offset ({loads:?})"
                );
            }
        }
        let lossless = ![&p.provider, &p.name, &p.arguments].iter().any(|s| s.contains('\u{fffd}'));
        if elf64_le && lossless {
            let mut desc = Vec::new();
            desc.extend(p.address.wrapping_sub(delta).to_le_bytes());
            desc.extend(p.note_base.to_le_bytes());
            desc.extend(p.semaphore.map_or(0, |s| s.wrapping_sub(delta)).to_le_bytes());
            for s in [&p.provider, &p.name, &p.arguments] {
                desc.extend(s.as_bytes());
                desc.push(0);
            }
            prop_assert!(
                note_bytes.iter().any(|n| n.windows(desc.len()).any(|w| w == desc)),
                "{p:?}: its descriptor is in no note section"
            );
        }
        if let Ok(args) = &p.args {
            let tokens: Vec<&str> = p.arguments.split_ascii_whitespace().collect();
            prop_assert_eq!(args.len(), tokens.len());
            for (a, t) in args.iter().zip(&tokens) {
                prop_assert_eq!(&a.text, t);
                prop_assert!(!matches!(a.location, ArgLocation::Symbol { .. }), "{a:?} left unresolved");
            }
            prop_assert_eq!(p.bpf_spec().is_ok(), args.len() <= profiler_common::USDT_MAX_ARGS);
        }
        let _ = p.to_string();
    }
    // What `attach` does with the file: CPython's probes, version and tracing switch.
    let _ = python::usdt::resolve(&[PathBuf::from("fuzzed")], |_| Some(d));
    Ok(())
}

proptest! {
    #![proptest_config(config(4))]

    #[test]
    fn fuzz_usdt_notes_of_mutated_files((seed, muts) in seed_and_mutations(&NOTE_SEEDS)) {
        let d = mutate(seed, &muts);
        check_notes(&d).map_err(|e| TestCaseError::fail(format!("{}: {e}", seed.name)))?;
    }
}

/// A `.note.stapsdt` entry with a free-form descriptor.
fn raw_note(desc: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(8u32.to_le_bytes());
    out.extend((desc.len() as u32).to_le_bytes());
    out.extend(3u32.to_le_bytes());
    out.extend(b"stapsdt\0");
    out.extend(desc);
    out.resize(out.len().next_multiple_of(4), 0);
    out
}

proptest! {
    #![proptest_config(config(1))]

    /// Notes built from parts: addresses anywhere (in the segments, at their edges, wrapping), strings of any bytes
    /// with or without their NULs, arguments from the corpus or random.
    #[test]
    fn fuzz_usdt_notes_built_from_parts(
        notes in prop::collection::vec(
            (
                prop_oneof![3 => Just(BUILT_TEXT_ADDR + 0x10), 3 => BUILT_TEXT_ADDR..BUILT_TEXT_ADDR + 0x1100, 1 => interesting_u64()],
                prop_oneof![Just(0u64), Just(0x40_0800), interesting_u64()],
                prop_oneof![3 => Just(0u64), 3 => BUILT_DATA_ADDR..BUILT_DATA_ADDR + 0x900, 1 => interesting_u64()],
                prop_oneof![Just(b"python".to_vec()), prop::collection::vec(any::<u8>(), 0..8)],
                prop_oneof![Just(b"function__entry".to_vec()), prop::collection::vec(any::<u8>(), 0..8)],
                prop_oneof![
                    prop::sample::select(lines(USDT_ARGS)).prop_map(|s| s.as_bytes().to_vec()),
                    "[-0-9a-z%$@(),+_. ]{0,40}".prop_map(String::into_bytes),
                ],
                // How many of the three strings lose their NUL, and where the descriptor is cut.
                prop_oneof![6 => Just(0usize), 1 => 1usize..4],
                prop::option::weighted(0.1, 0usize..40),
            ),
            0..5,
        ),
        base in prop::option::of(interesting_u64()),
        machine in prop_oneof![Just(62u16), any::<u16>()],
    ) {
        let mut section = Vec::new();
        for (pc, note_base, sem, provider, name, args, nuls, cut) in notes {
            let mut desc = Vec::new();
            for a in [pc, note_base, sem] {
                desc.extend(a.to_le_bytes());
            }
            for (i, s) in [provider, name, args].into_iter().enumerate() {
                desc.extend(s);
                if i < 3 - nuls {
                    desc.push(0);
                }
            }
            if let Some(cut) = cut {
                desc.truncate(cut);
            }
            section.extend(raw_note(&desc));
        }
        check_notes(&built_usdt_elf_with(section, base, machine))?;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// USDT argument specs

/// A register name in one of its widths, and the full register it names.
fn register_name() -> impl Strategy<Value = (String, &'static str)> {
    let legacy: Vec<(&str, &str)> = vec![
        ("rax", "rax"),
        ("eax", "rax"),
        ("ax", "rax"),
        ("al", "rax"),
        ("ah", "rax"),
        ("rbx", "rbx"),
        ("bl", "rbx"),
        ("bh", "rbx"),
        ("ecx", "rcx"),
        ("ch", "rcx"),
        ("dx", "rdx"),
        ("rsi", "rsi"),
        ("sil", "rsi"),
        ("edi", "rdi"),
        ("rbp", "rbp"),
        ("bpl", "rbp"),
        ("rsp", "rsp"),
        ("esp", "rsp"),
        ("rip", "rip"),
    ];
    const NUMBERED: [&str; 8] = ["r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15"];
    prop_oneof![
        prop::sample::select(legacy).prop_map(|(n, f)| (n.to_owned(), f)),
        (0usize..8, prop::sample::select(vec!["", "d", "w", "b", "l"]))
            .prop_map(|(i, suffix)| (format!("{}{suffix}", NUMBERED[i]), NUMBERED[i])),
    ]
    .prop_flat_map(|(n, f)| (Just(n), Just(f), any::<bool>()))
    .prop_map(|(n, f, upper)| (if upper { n.to_ascii_uppercase() } else { n }, f))
}

/// A well-formed argument, and what it must decode to (registers by full name).
#[derive(Clone, Debug)]
enum Expected {
    Constant(i64),
    Register(&'static str),
    Memory { base: Option<&'static str>, index: Option<(&'static str, u8)>, displacement: i64 },
    Symbol { symbol: String, addend: i64, deref: bool },
}

fn number_text(n: i64, hex: bool) -> String {
    match (hex, n < 0) {
        (false, _) => n.to_string(),
        (true, false) => format!("{n:#x}"),
        (true, true) => format!("-{:#x}", n.unsigned_abs()),
    }
}

fn well_formed_argument() -> impl Strategy<Value = (String, u8, bool, Expected)> {
    let size = prop::sample::select(vec![1i8, 2, 4, 8, -1, -2, -4, -8]);
    let disp = prop_oneof![Just(0i64), -0x1000i64..0x1000, any::<i64>()];
    let symbol = "[a-zA-Z_.][a-zA-Z0-9_.]{0,12}";
    let operand = prop_oneof![
        (disp.clone(), any::<bool>()).prop_map(|(n, hex)| (format!("${}", number_text(n, hex)), Expected::Constant(n))),
        register_name().prop_map(|(n, f)| (format!("%{n}"), Expected::Register(f))),
        (
            disp.clone(),
            any::<bool>(),
            prop::option::of(register_name()),
            prop::option::of((register_name(), prop::sample::select(vec![1u8, 2, 4, 8]), any::<bool>()))
        )
            .prop_filter("rip takes no index", |(_, _, base, index)| {
                base.as_ref().is_none_or(|b| b.1 != "rip") && index.as_ref().is_none_or(|i| i.0.1 != "rip")
            })
            .prop_filter("a bare displacement is an absolute address, not this form", |(_, _, base, index)| base
                .is_some()
                || index.is_some())
            .prop_map(|(n, hex, base, index)| {
                let d = if n == 0 && hex { String::new() } else { number_text(n, hex) };
                let b = base.as_ref().map_or(String::new(), |b| format!("%{}", b.0));
                let text = match &index {
                    None => format!("{d}({b})"),
                    Some(((i, _), scale, explicit)) if *scale == 1 && !explicit => format!("{d}({b},%{i})"),
                    Some(((i, _), scale, _)) => format!("{d}({b},%{i},{scale})"),
                };
                let expected = Expected::Memory {
                    base: base.map(|b| b.1),
                    index: index.map(|((_, f), s, _)| (f, s)),
                    displacement: n,
                };
                (text, expected)
            }),
        (symbol, -0x100i64..0x100, 0u8..3).prop_map(|(s, addend, form)| {
            let tail = match addend {
                0 => String::new(),
                a if a > 0 => format!("+{a}"),
                a => a.to_string(),
            };
            match form {
                0 => (format!("{s}{tail}(%rip)"), Expected::Symbol { symbol: s, addend, deref: true }),
                1 => (format!("{s}{tail}"), Expected::Symbol { symbol: s, addend, deref: true }),
                _ => (format!("${s}{tail}"), Expected::Symbol { symbol: s, addend, deref: false }),
            }
        }),
    ];
    (size, operand).prop_map(|(size, (op, expected))| (format!("{size}@{op}"), size.unsigned_abs(), size < 0, expected))
}

fn location_matches(got: &ArgLocation, want: &Expected) -> bool {
    let full = |r: &usdt::Register| r.full;
    match (got, want) {
        (ArgLocation::Constant(a), Expected::Constant(b)) => a == b,
        (ArgLocation::Register(r), Expected::Register(f)) => full(r) == *f,
        (
            ArgLocation::Memory { base, index, displacement },
            Expected::Memory { base: b, index: i, displacement: d },
        ) => base.as_ref().map(full) == *b && index.as_ref().map(|(r, s)| (full(r), *s)) == *i && displacement == d,
        (ArgLocation::Symbol { symbol, addend, deref }, Expected::Symbol { symbol: s, addend: a, deref: r }) => {
            symbol == s && addend == a && deref == r
        }
        _ => false,
    }
}

/// What holds for any string `parse_arguments` accepts.
fn check_arguments(spec: &str) -> Result<(), TestCaseError> {
    let Ok(args) = usdt::parse_arguments(spec) else { return Ok(()) };
    let tokens: Vec<&str> = spec.split_ascii_whitespace().collect();
    prop_assert_eq!(args.len(), tokens.len());
    for (a, t) in args.iter().zip(&tokens) {
        prop_assert_eq!(&a.text, t);
        prop_assert!(matches!(a.size, 1 | 2 | 4 | 8), "{a:?}");
        prop_assert_eq!(a.signed, t.starts_with('-'), "{:?}", a);
        let spec = a.bpf_spec();
        prop_assert_eq!(spec.is_err(), matches!(a.location, ArgLocation::Symbol { .. }), "{:?}", a);
        if let Ok(s) = spec {
            prop_assert_eq!(s.size, u32::from(a.size));
            // Register offsets are inside x86-64 `struct pt_regs` (21 slots of 8 bytes).
            for off in [s.reg_offset, s.index_offset] {
                prop_assert!(off == profiler_common::USDT_NO_REG || off < 21 * 8, "{:?}: offset {}", a, off);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(1))]

    #[test]
    fn fuzz_usdt_arguments_of_arbitrary_text(spec in prop_oneof![".{0,48}", "[-+0-9a-fx%$@(),_. \t]{0,48}", "(-?[1248]@[-+0-9a-z%$(),_.]{0,16} ?){0,7}"]) {
        check_arguments(&spec)?;
        let _ = usdt::register(&spec);
        let _ = placement::kernel_version(&spec);
    }

    #[test]
    fn fuzz_usdt_arguments_of_mutated_real_specs(
        spec in prop::sample::select(lines(USDT_ARGS)),
        edits in prop::collection::vec((any::<Index>(), 0u8..3, prop::sample::select(b"-+0123456789abcdefxz%$@(),_. ".to_vec())), 0..6),
    ) {
        let mut s = spec.as_bytes().to_vec();
        for (at, op, b) in edits {
            let at = at.index(s.len() + 1);
            match op {
                0 => s.insert(at, b),
                1 if at < s.len() => { s.remove(at); }
                _ if at < s.len() => s[at] = b,
                _ => s.push(b),
            }
        }
        check_arguments(&String::from_utf8_lossy(&s))?;
    }

    /// Well-formed arguments decode to exactly what was written.
    #[test]
    fn fuzz_usdt_arguments_round_trip(args in prop::collection::vec(well_formed_argument(), 0..7), sep in prop::sample::select(vec![" ", "  ", "\t"])) {
        let spec = args.iter().map(|a| a.0.as_str()).collect::<Vec<_>>().join(sep);
        let got: Vec<UsdtArg> = match usdt::parse_arguments(&spec) {
            Ok(got) => got,
            Err(ArgSpecError::NumericRipRelative { .. }) => return Ok(()),
            Err(e) => return Err(TestCaseError::fail(format!("'{spec}': {e}"))),
        };
        prop_assert_eq!(got.len(), args.len());
        for (g, (text, size, signed, want)) in got.iter().zip(&args) {
            prop_assert_eq!(&g.text, text);
            prop_assert_eq!((g.size, g.signed), (*size, *signed), "{}", text);
            prop_assert!(location_matches(&g.location, want), "'{text}': got {:?}, want {want:?}", g.location);
        }
        check_arguments(&spec)?;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Probe placement

/// A placement is at an instruction boundary inside the bytes, reached from the entry by `passed` straight-line,
/// side-effect-free instructions, on an instruction class the kernel emulates; it does not depend on bytes after
/// the probe point's instruction; a fallback stays at the entry.
fn check_placement(code: &[u8], address: u64, kernel: placement::KernelVersion) -> Result<Placement, TestCaseError> {
    let p = placement::choose(code, address, kernel);
    let _ = p.to_string();
    match &p.reason {
        PlacementReason::Fallback(_) => prop_assert_eq!((p.offset, p.stack_adjust), (0, 0)),
        PlacementReason::EntryEmulated(e) => {
            prop_assert_eq!((p.offset, p.stack_adjust), (0, 0));
            prop_assert!(e.since() <= kernel);
        }
        PlacementReason::Moved { emulated, passed } => {
            prop_assert!(emulated.since() <= kernel);
            prop_assert!(p.offset > 0 && (p.offset as usize) < code.len(), "{p} in {} bytes", code.len());
            prop_assert!(*passed >= 1);
            prop_assert!(p.stack_adjust.is_multiple_of(8) && p.stack_adjust <= 8 * u64::from(*passed), "{p}");
            let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
            let mut insn = Instruction::default();
            for _ in 0..*passed {
                decoder.decode_out(&mut insn);
                prop_assert!(!insn.is_invalid());
                prop_assert_eq!(insn.flow_control(), FlowControl::Next, "passed {:?}", insn.mnemonic());
                prop_assert!(
                    crate::probes::placement::SIDE_EFFECT_FREE.contains(&insn.mnemonic()),
                    "passed {:?}",
                    insn.mnemonic()
                );
            }
            prop_assert_eq!(decoder.position() as u64, p.offset, "{}: not the instruction after {} passed", p, passed);
            decoder.decode_out(&mut insn);
            prop_assert!(!insn.is_invalid());
            // Bytes after the probe point's instruction change nothing (they can only add branches into it).
            let end = decoder.position();
            prop_assert_eq!(&placement::choose(&code[..end], address, kernel), &p);
        }
    }
    Ok(p)
}

fn kernel() -> impl Strategy<Value = placement::KernelVersion> {
    prop_oneof![
        prop::sample::select(vec![(3, 14), (4, 15), (4, 16), (5, 15), (6, 1), (6, 2), (6, 15), (6, 16), (6, 18)]),
        (any::<u32>(), any::<u32>()),
    ]
}

fn address() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0x32_f860u64), any::<u64>(), (u64::MAX - 128)..=u64::MAX, 0u64..128]
}

/// Instruction pieces that prologues and the genuine driver's entries are made of.
const PIECES: [&[u8]; 16] = [
    &[0x55],                                                       // push rbp
    &[0x41, 0x54],                                                 // push r12
    &[0x48, 0x89, 0xe5],                                           // mov rbp, rsp
    &[0xf3, 0x0f, 0x1e, 0xfa],                                     // endbr64
    &[0x83, 0x3d, 0x3e, 0x93, 0x8d, 0x01, 0x00],                   // cmpl $0, rip
    &[0x81, 0x3d, 0x3e, 0x93, 0x8d, 0x01, 0x00, 0xba, 0x1c, 0x32], // cmpl $imm32, rip
    &[0x74, 0x0c],                                                 // je
    &[0x0f, 0x85, 0x10, 0, 0, 0],                                  // jne rel32
    &[0xeb, 0xfc],                                                 // jmp back
    &[0xe8, 0, 0, 0, 0],                                           // call
    &[0xff, 0x25, 0xc6, 0x18, 0x7e, 0x01],                         // jmp *rip
    &[0x66, 0x90],                                                 // xchg ax, ax
    &[0x0f, 0x1f, 0x44, 0x00, 0x00],                               // nop5
    &[0x48, 0x83, 0xec, 0x18],                                     // sub rsp, 0x18
    &[0x48, 0x8b, 0x07],                                           // mov rax, [rdi]
    &[0x64, 0x48, 0x8b, 0x04, 0x25, 0x28, 0, 0, 0],                // mov rax, fs:0x28
];

proptest! {
    #![proptest_config(config(1))]

    #[test]
    fn fuzz_placement_of_arbitrary_bytes(code in prop::collection::vec(any::<u8>(), 0..80), address in address(), kernel in kernel()) {
        check_placement(&code, address, kernel)?;
    }

    #[test]
    fn fuzz_placement_of_mutated_entries(
        window in prop::sample::select(entry_windows()),
        edits in prop::collection::vec((any::<Index>(), 0u8..4, any::<u8>(), 0usize..PIECES.len()), 0..6),
        address in address(),
        kernel in kernel(),
    ) {
        let mut code = window.to_vec();
        for (at, op, byte, piece) in edits {
            let at = at.index(code.len() + 1);
            match op {
                0 if at < code.len() => code[at] = byte,
                1 => { code.splice(at..at, PIECES[piece].iter().copied()); }
                2 => code.truncate(at),
                _ => { code.splice(..0, PIECES[piece].iter().copied()); }
            }
        }
        check_placement(&code, address, kernel)?;
    }

    /// Prologues assembled from the pieces: most walk to a moved probe point, which the checks then examine.
    #[test]
    fn fuzz_placement_of_assembled_prologues(pieces in prop::collection::vec(0usize..PIECES.len(), 1..10), address in address(), kernel in kernel()) {
        let code: Vec<u8> = pieces.iter().flat_map(|&i| PIECES[i].iter().copied()).collect();
        check_placement(&code, address, kernel)?;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Ring-buffer records

const HEADER: usize = size_of::<RecordHeader>();
const LAUNCH: usize = size_of::<LaunchRecord>();
const ORDERED: usize = size_of::<OrderedRecord>();
const NAME: usize = size_of::<KernelNameRecord>();

fn u32_field(d: &[u8], at: usize) -> u32 {
    u32_at(d, at).unwrap_or(u32::MAX)
}
fn u64_field(d: &[u8], at: usize) -> u64 {
    u64_at(d, at).unwrap_or(u64::MAX)
}

/// A decoded record's fields are the bytes at the layout's offsets; its kind and length decide Ok or which error.
fn check_record(d: &[u8]) -> Result<(), TestCaseError> {
    use std::mem::offset_of;
    let got = events::decode(d);
    if d.len() < HEADER {
        prop_assert_eq!(got, Err(events::DecodeError::Short(d.len())));
        return Ok(());
    }
    let kind = u32_field(d, offset_of!(RecordHeader, kind));
    let tid = u32_field(d, offset_of!(RecordHeader, tid));
    let ts = u64_field(d, offset_of!(RecordHeader, ts_ns));
    let Some(k) = RecordKind::from_u32(kind) else {
        prop_assert_eq!(got, Err(events::DecodeError::Kind(kind)));
        return Ok(());
    };
    let expected_len = match k {
        RecordKind::Launch => Some(LAUNCH),
        RecordKind::StepEnter
        | RecordKind::StepExit
        | RecordKind::SyncEnter
        | RecordKind::SyncExit
        | RecordKind::ThreadExit => Some(ORDERED),
        RecordKind::KernelName => Some(NAME),
        RecordKind::LoaderChange => Some(HEADER),
        #[allow(unreachable_patterns, reason = "record kinds added later decode to whatever they decode to")]
        _ => None,
    };
    if let Some(len) = expected_len
        && d.len() != len
    {
        prop_assert_eq!(got, Err(events::DecodeError::Length { kind, len: d.len(), expected: len }));
        return Ok(());
    }
    let event = match got {
        Ok(e) => e,
        Err(events::DecodeError::Api(api)) => {
            prop_assert_eq!(k, RecordKind::Launch);
            prop_assert_eq!(api, u32_field(d, offset_of!(LaunchRecord, api)));
            prop_assert!(LaunchApi::from_u32(api).is_none());
            return Ok(());
        }
        // A kind added after this test was written: its length rule is not known here.
        Err(events::DecodeError::Length { .. }) if expected_len.is_none() => return Ok(()),
        Err(e) => return Err(TestCaseError::fail(format!("kind {kind}, {} bytes: {e}", d.len()))),
    };
    prop_assert_eq!(event.ts_ns(), ts);
    match (&event, k) {
        (Event::Launch(l), RecordKind::Launch) => {
            prop_assert_eq!(l.tid, tid);
            prop_assert_eq!(l.api as u32, u32_field(d, offset_of!(LaunchRecord, api)));
            prop_assert_eq!(l.function, u64_field(d, offset_of!(LaunchRecord, function)));
            prop_assert_eq!(l.stream, u64_field(d, offset_of!(LaunchRecord, stream)));
            prop_assert_eq!(l.shared_mem_bytes, u32_field(d, offset_of!(LaunchRecord, shared_mem_bytes)));
            for i in 0..3 {
                prop_assert_eq!(l.grid[i], u32_field(d, offset_of!(LaunchRecord, grid) + 4 * i));
                prop_assert_eq!(l.block[i], u32_field(d, offset_of!(LaunchRecord, block) + 4 * i));
            }
        }
        (
            Event::StepEnter(s) | Event::StepExit(s) | Event::SyncEnter(s) | Event::SyncExit(s) | Event::ThreadExit(s),
            RecordKind::StepEnter
            | RecordKind::StepExit
            | RecordKind::SyncEnter
            | RecordKind::SyncExit
            | RecordKind::ThreadExit,
        ) => {
            let want = match k {
                RecordKind::StepEnter => matches!(event, Event::StepEnter(_)),
                RecordKind::StepExit => matches!(event, Event::StepExit(_)),
                RecordKind::SyncEnter => matches!(event, Event::SyncEnter(_)),
                RecordKind::SyncExit => matches!(event, Event::SyncExit(_)),
                _ => matches!(event, Event::ThreadExit(_)),
            };
            prop_assert!(want, "kind {kind} decoded as {event:?}");
            prop_assert_eq!(s.tid, tid);
            prop_assert_eq!(s.probe, u32_field(d, offset_of!(OrderedRecord, probe)));
            prop_assert_eq!(s.counters.launches, u64_field(d, offset_of!(OrderedRecord, thread_launches)));
            prop_assert_eq!(s.seq, u32_field(d, offset_of!(OrderedRecord, seq)));
            prop_assert_eq!(s.depth, u32_field(d, offset_of!(OrderedRecord, depth)));
        }
        (Event::KernelName(n), RecordKind::KernelName) => {
            prop_assert_eq!(n.which, u32_field(d, offset_of!(KernelNameRecord, which)));
            prop_assert_eq!(n.handle, u64_field(d, offset_of!(KernelNameRecord, handle)));
            prop_assert_eq!(n.kernel, u64_field(d, offset_of!(KernelNameRecord, kernel)));
            let name = &d[offset_of!(KernelNameRecord, name)..];
            let len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
            prop_assert_eq!(n.name.as_bytes() == &name[..len], std::str::from_utf8(&name[..len]).is_ok());
            prop_assert!(!n.name.contains('\0'));
        }
        (Event::LoaderChange { .. }, RecordKind::LoaderChange) => {}
        (
            _,
            RecordKind::Launch
            | RecordKind::StepEnter
            | RecordKind::StepExit
            | RecordKind::SyncEnter
            | RecordKind::SyncExit
            | RecordKind::ThreadExit
            | RecordKind::KernelName
            | RecordKind::LoaderChange,
        ) => {
            return Err(TestCaseError::fail(format!("kind {kind} decoded as {event:?}")));
        }
        #[allow(unreachable_patterns, reason = "record kinds added later decode to whatever they decode to")]
        _ => {}
    }
    Ok(())
}

/// `records` splits the bytes into pieces that cover them exactly: one piece, or a run of launch records.
fn check_records(d: &[u8]) -> Result<(), TestCaseError> {
    let pieces: Vec<&[u8]> = events::records(d).collect();
    prop_assert_eq!(pieces.concat(), d);
    if pieces.len() > 1 {
        prop_assert!(pieces.iter().all(|p| p.len() == LAUNCH));
        prop_assert_eq!(u32_field(d, 0), RecordKind::Launch as u32);
    }
    for p in pieces {
        prop_assert!(!p.is_empty());
        check_record(p)?;
    }
    Ok(())
}

/// A record of `kind` (a real kind mostly), `len` bytes near its size, random fields; for launch records a known
/// `api` most of the time, and for name records a NUL somewhere most of the time.
fn record() -> impl Strategy<Value = Vec<u8>> {
    let kinds: Vec<u32> = (0..=9).chain([u32::MAX, 0x100]).collect();
    (prop::sample::select(kinds), -3isize..4, 0u8..3, any::<u64>())
        .prop_flat_map(|(kind, off, len_mode, seed)| {
            let size = match RecordKind::from_u32(kind) {
                Some(RecordKind::Launch) => LAUNCH,
                Some(RecordKind::KernelName) => NAME,
                Some(RecordKind::LoaderChange) => HEADER,
                _ => ORDERED,
            };
            let len = if len_mode == 0 { size.saturating_add_signed(off) } else { size };
            (Just(kind), prop::collection::vec(any::<u8>(), len), Just(seed))
        })
        .prop_map(|(kind, mut d, seed)| {
            if let Some(k) = d.get_mut(..4) {
                k.copy_from_slice(&kind.to_le_bytes()[..]);
            }
            if kind == RecordKind::Launch as u32 && seed % 4 != 0 && d.len() >= 20 {
                let api = LaunchApi::ALL[(seed as usize / 4) % LaunchApi::ALL.len()] as u32;
                d[16..20].copy_from_slice(&api.to_le_bytes());
            }
            if kind == RecordKind::KernelName as u32 && seed % 3 != 0 && d.len() == NAME {
                let at = 40 + (seed as usize / 3) % 256;
                d[at] = 0;
            }
            d
        })
}

proptest! {
    #![proptest_config(config(1))]

    #[test]
    fn fuzz_records_of_arbitrary_bytes(d in bytes_near(vec![0, HEADER, LAUNCH, ORDERED, NAME, 2 * LAUNCH, 16 * LAUNCH], 1200)) {
        check_records(&d)?;
    }

    #[test]
    fn fuzz_records_built_from_fields(r in record(), run in 1usize..17) {
        check_records(&r)?;
        // A staged run of the same record.
        check_records(&r.repeat(run))?;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Seeds themselves: the corpus is what it says, and its ground truth holds without mutation.

#[test]
fn fuzz_seeds_parse_to_their_ground_truth() {
    // The python3.11 cut keeps all of CPython's probes, with offsets through python3.11's own program headers.
    let probes = usdt::parse_notes(PYTHON_USDT_ELF).expect("the python3.11 cut parses");
    assert!(usdt::find(&probes, "python", "function__entry").count() >= 1, "{probes:?}");
    assert!(probes.iter().all(|p| p.semaphore_file_offset.is_some() && p.args.is_ok()), "{probes:?}");
    let py = python::usdt::resolve(&[PathBuf::from("corpus")], |_| Some(PYTHON_USDT_ELF)).expect("resolves");
    assert_eq!(py.version, Some((3, 11)));
    assert!(py.tracing_switch.is_some());
    if let Ok(full) = std::fs::read(SYSTEM_PYTHON)
        && cut_source(SYSTEM_PYTHON, &full, PYTHON_USDT_ELF)
    {
        assert_eq!(usdt::parse_notes(&full).expect("python3.11 parses"), probes, "the cut is faithful");
    }
    // The libc cut: every symbol resolves through libc's program headers, as in the whole file.
    let symbols = elf::function_symbols(LIBC_SYMBOLS_ELF).expect("the libc cut parses");
    assert!(symbols.len() >= 48, "{}", symbols.len());
    assert!(symbols.iter().any(|s| s.name == "memcpy"), "versioned names lose their suffix");
    assert!(!symbols.iter().any(|s| s.name == "undefined_function" || s.name == "zero_address"));
    if let Ok(full) = std::fs::read(SYSTEM_LIBC) {
        let all = elf::function_symbols(&full).expect("libc parses");
        if cut_source(SYSTEM_LIBC, &full, LIBC_SYMBOLS_ELF) {
            for s in symbols.iter().filter(|s| s.name.starts_with("__libc_") || s.name.starts_with("pthread_")) {
                assert!(all.contains(s), "{s:?} is not libc's");
            }
        }
        // Ground truth in the whole file: the bytes at a symbol's offset are those of its section at its address.
        let file = object::File::parse(&*full).expect("parse");
        for s in all.iter().step_by(97) {
            let section = file
                .sections()
                .find(|sec| s.address >= sec.address() && s.address < sec.address() + sec.size())
                .expect("a section holds it");
            let (off, _) = section.file_range().expect("in the file");
            assert_eq!(s.file_offset, s.address - section.address() + off, "{s:?}");
        }
    }
    assert_eq!(ENTRY_WINDOWS.len() % placement::WINDOW, 0);
    assert!(entry_windows().len() >= 64);
    // The assembled genuine-driver shape is placed, so the placement checks see moved probes.
    let c = [PIECES[5], PIECES[6], PIECES[10]].concat();
    assert_eq!(placement::choose(&c, 0x1000, (6, 18)).offset, 0xa);
    for spec in lines(USDT_ARGS) {
        assert!(usdt::parse_arguments(spec).is_ok(), "{spec}");
    }
}

/// Whether `full`, the system file at `path`, is the build a corpus cut was
/// made from (the cut keeps its source's loadable segments). Another build (a
/// machine with another libc or python3.11) cannot be compared with the cut:
/// that part of the check is skipped, and says so.
fn cut_source(path: &str, full: &[u8], cut: &[u8]) -> bool {
    let loads = |data: &[u8]| -> Vec<(u64, u64, (u64, u64))> {
        let file = object::File::parse(data).expect("an ELF file");
        file.segments().map(|seg| (seg.address(), seg.size(), seg.file_range())).collect()
    };
    let same = loads(full) == loads(cut);
    if !same {
        crate::skip_test(format!(
            "{path} is another build than the corpus cut's (its loadable segments differ): the cut is not \
             compared with it; `cargo xtask fuzz-corpus` cuts this machine's"
        ));
    }
    same
}

// ---------------------------------------------------------------------------------------------------------------
// Hand-built ELF files, and the corpus generator.

const BUILT_TEXT_ADDR: u64 = 0x40_1000;
const BUILT_TEXT_OFF: u64 = 0x1000;
const BUILT_TEXT_SIZE: u64 = 0x1000;
const BUILT_DATA_ADDR: u64 = 0x60_3000;
const BUILT_DATA_OFF: u64 = 0x2000;

/// A section of a hand-built file: name, `sh_type`, `sh_flags`, `sh_addr` and its bytes (none for `SHT_NOBITS`).
struct SectionSpec {
    name: &'static str,
    kind: u32,
    flags: u64,
    addr: u64,
    bytes: Vec<u8>,
}

fn section(name: &'static str, kind: u32, flags: u64, addr: u64, bytes: Vec<u8>) -> SectionSpec {
    SectionSpec { name, kind, flags, addr, bytes }
}

/// A program header: (p_type, p_flags, p_offset, p_vaddr, p_filesz, p_memsz); a `PT_INTERP` gets the offset and size
/// of the `.interp` section filled in.
type Phdr = (u32, u32, u64, u64, u64, u64);

/// A symbol: (name, st_info, st_shndx, st_value); 16 bytes long.
type SymbolSpec<'a> = (&'a str, u8, u16, u64);

/// What a hand-built ELF64 LE file (`ET_DYN`) holds. Sections are indexed from 1 in the order given; `.symtab` and
/// `.strtab` follow them when `symtab` has symbols, then `.dynsym` and `.dynstr` when `dynsym` has, then `.shstrtab`.
struct ElfSpec<'a> {
    machine: u16,
    phdrs: &'a [Phdr],
    sections: Vec<SectionSpec>,
    symtab: &'a [SymbolSpec<'a>],
    dynsym: &'a [SymbolSpec<'a>],
}

impl<'a> ElfSpec<'a> {
    fn new(machine: u16, phdrs: &'a [Phdr], sections: Vec<SectionSpec>) -> Self {
        ElfSpec { machine, phdrs, sections, symtab: &[], dynsym: &[] }
    }
}

/// The file `spec` describes, laid out by `object::write::elf::Writer`: header, program headers, the sections' bytes,
/// the symbol and string tables, section headers.
fn build_elf64(spec: &ElfSpec) -> Vec<u8> {
    use object::write::elf::{FileHeader, ProgramHeader, SectionHeader, Sym, Writer};
    let mut out = Vec::new();
    let mut w = Writer::new(object::Endianness::Little, true, &mut out);
    w.reserve_file_header();
    w.reserve_program_headers(spec.phdrs.len() as u32);
    let names: Vec<_> = spec.sections.iter().map(|s| w.add_section_name(s.name.as_bytes())).collect();
    for _ in &spec.sections {
        w.reserve_section_index();
    }
    let sym_names: Vec<_> = spec.symtab.iter().map(|s| w.add_string(s.0.as_bytes())).collect();
    if !spec.symtab.is_empty() {
        w.reserve_null_symbol_index();
        for _ in spec.symtab {
            w.reserve_symbol_index(None);
        }
        w.reserve_symtab_section_index();
        w.reserve_strtab_section_index();
    }
    let dyn_names: Vec<_> = spec.dynsym.iter().map(|s| w.add_dynamic_string(s.0.as_bytes())).collect();
    if !spec.dynsym.is_empty() {
        w.reserve_null_dynamic_symbol_index();
        for _ in spec.dynsym {
            w.reserve_dynamic_symbol_index();
        }
        w.reserve_dynsym_section_index();
        w.reserve_dynstr_section_index();
    }
    w.reserve_shstrtab_section_index();
    let placed: Vec<usize> = spec.sections.iter().map(|s| w.reserve(s.bytes.len(), 8)).collect();
    w.reserve_symtab();
    w.reserve_strtab();
    w.reserve_dynsym();
    w.reserve_dynstr();
    w.reserve_shstrtab();
    w.reserve_section_headers();

    let header = FileHeader {
        os_abi: 0,
        abi_version: 0,
        e_type: object::elf::ET_DYN,
        e_machine: spec.machine,
        e_entry: 0,
        e_flags: 0,
    };
    w.write_file_header(&header).expect("file header");
    w.write_align_program_headers();
    let interp = spec.sections.iter().position(|s| s.name == ".interp");
    for &(p_type, p_flags, mut p_offset, p_vaddr, mut p_filesz, p_memsz) in spec.phdrs {
        if let (object::elf::PT_INTERP, Some(i)) = (p_type, interp) {
            (p_offset, p_filesz) = (placed[i] as u64, spec.sections[i].bytes.len() as u64);
        }
        let paddr = p_vaddr;
        w.write_program_header(&ProgramHeader {
            p_type,
            p_flags,
            p_offset,
            p_vaddr,
            p_paddr: paddr,
            p_filesz,
            p_memsz,
            p_align: 0x1000,
        });
    }
    for s in &spec.sections {
        w.write_align(8);
        w.write(&s.bytes);
    }
    let sym = |name, &(_, st_info, st_shndx, st_value): &SymbolSpec| Sym {
        name: Some(name),
        section: None,
        st_info,
        st_other: 0,
        st_shndx,
        st_value,
        st_size: 16,
    };
    w.write_null_symbol();
    for (s, &name) in spec.symtab.iter().zip(&sym_names) {
        w.write_symbol(&sym(name, s));
    }
    w.write_strtab();
    w.write_null_dynamic_symbol();
    for (s, &name) in spec.dynsym.iter().zip(&dyn_names) {
        w.write_dynamic_symbol(&sym(name, s));
    }
    w.write_dynstr();
    w.write_shstrtab();
    w.write_null_section_header();
    for ((s, &name), &offset) in spec.sections.iter().zip(&names).zip(&placed) {
        w.write_section_header(&SectionHeader {
            name: Some(name),
            sh_type: s.kind,
            sh_flags: s.flags,
            sh_addr: s.addr,
            sh_offset: offset as u64,
            sh_size: s.bytes.len() as u64,
            sh_link: 0,
            sh_info: 0,
            sh_addralign: 1,
            sh_entsize: 0,
        });
    }
    // Every symbol but the null one is global.
    w.write_symtab_section_header(1);
    w.write_strtab_section_header();
    w.write_dynsym_section_header(0, 1);
    w.write_dynstr_section_header(0);
    w.write_shstrtab_section_header();
    out
}

fn built_phdrs() -> Vec<Phdr> {
    vec![
        (3, 4, 0, 0, 0, 0),
        (1, 5, BUILT_TEXT_OFF, BUILT_TEXT_ADDR, BUILT_TEXT_SIZE, BUILT_TEXT_SIZE),
        (1, 6, BUILT_DATA_OFF, BUILT_DATA_ADDR, 0x100, 0x800),
    ]
}

/// Symbol tables with the names the reader treats specially (versions, mangling, undefined, address 0), in a file
/// with `PT_INTERP`.
fn built_symbols_elf() -> Vec<u8> {
    const FUNC: u8 = 0x12;
    let t = BUILT_TEXT_ADDR;
    let symtab = [
        ("train_step", FUNC, 2, t + 0x10),
        ("memcpy@GLIBC_2.2.5", FUNC, 2, t + 0x20),
        ("memcpy@@GLIBC_2.14", FUNC, 2, t + 0x30),
        ("_ZN7Trainer4stepEv", FUNC, 2, t + 0x40),
        ("_ZN5myapp10train_step17h0123456789abcdefE", FUNC, 2, t + 0x50),
        ("_Z6matmulPfS_S_i", 0x02, 2, t + 0x60),
        ("undefined_function", FUNC, 0, t + 0x70),
        ("zero_address", FUNC, 2, 0),
        ("a_variable", 0x11, 3, BUILT_DATA_ADDR + 8),
        ("past_the_segments", FUNC, 2, t + 0x10_0000),
        ("in_the_data_tail", FUNC, 3, BUILT_DATA_ADDR + 0x700),
    ];
    let dynsym = [("train_step", FUNC, 2, t + 0x10), ("cuLaunchKernel", FUNC, 2, t + 0x80)];
    let sections = vec![
        section(".interp", 1, 2, 0, b"/lib64/ld-linux-x86-64.so.2\0".to_vec()),
        section(".text", 8, 6, t, Vec::new()),
        section(".data", 8, 3, BUILT_DATA_ADDR, Vec::new()),
    ];
    build_elf64(&ElfSpec { symtab: &symtab, dynsym: &dynsym, ..ElfSpec::new(62, &built_phdrs(), sections) })
}

/// A `stapsdt` note as `sys/sdt.h` writes it.
fn stapsdt_note(pc: u64, base: u64, semaphore: u64, provider: &str, name: &str, args: &str) -> Vec<u8> {
    let mut desc = Vec::new();
    for a in [pc, base, semaphore] {
        desc.extend(a.to_le_bytes());
    }
    for s in [provider, name, args] {
        desc.extend(s.as_bytes());
        desc.push(0);
    }
    raw_note(&desc)
}

/// Notes with every argument form, including symbolic ones resolved through `.symtab`.
fn built_usdt_elf() -> Vec<u8> {
    let t = BUILT_TEXT_ADDR;
    let notes = [
        stapsdt_note(t + 0x10, 0, BUILT_DATA_ADDR + 0x40, "python", "function__entry", "8@%rbp 8@%r12 -4@%eax"),
        stapsdt_note(t + 0x20, 0, BUILT_DATA_ADDR + 0x40, "python", "function__return", "8@%rbp 8@%r12 -4@%eax"),
        stapsdt_note(t + 0x30, 0, BUILT_DATA_ADDR + 0x42, "python", "line", "8@%r14 8@%rax -4@%ebp"),
        stapsdt_note(t + 0x40, 0, 0, "app", "forms", "-4@112(%rsp) 8@-8(%rbp,%rax,8) 4@$-1 2@%ax 1@%ah"),
        stapsdt_note(
            t + 0x50,
            0,
            BUILT_DATA_ADDR + 0x500,
            "app",
            "symbols",
            "8@counter(%rip) -4@counter+8(%rip) 4@global 8@$global+4",
        ),
        stapsdt_note(t + 0x60, 0, 0, "app", "missing", "8@missing(%rip)"),
    ]
    .concat();
    built_usdt_elf_with(notes, Some(0x40_0800), 62)
}

/// A file around the given `.note.stapsdt` bytes, with `.stapsdt.base` at `base` and symbols for symbolic operands.
fn built_usdt_elf_with(notes: Vec<u8>, base: Option<u64>, machine: u16) -> Vec<u8> {
    let symtab = [("counter", 0x11, 2, BUILT_DATA_ADDR + 0x40), ("global", 0x11, 2, BUILT_DATA_ADDR + 0x80)];
    let mut sections =
        vec![section(".note.stapsdt", 7, 0, 0, notes), section(".data", 8, 3, BUILT_DATA_ADDR, Vec::new())];
    sections.extend(base.map(|b| section(".stapsdt.base", 1, 2, b, vec![0])));
    build_elf64(&ElfSpec { symtab: &symtab, ..ElfSpec::new(machine, &built_phdrs(), sections) })
}

/// Writes `tests/corpus/` from this machine's python3.11, libc and libstdc++ (Debian 12). Run only when asked:
/// `cargo xtask fuzz-corpus`.
#[test]
#[ignore = "writes tests/corpus/ from system files; run by `cargo xtask fuzz-corpus`"]
fn regenerate_corpus() {
    use object::{ObjectSymbol, read::elf::ProgramHeader};
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).expect("corpus dir");
    let read = |p: &str| std::fs::read(p).unwrap_or_else(|e| panic!("{p}: {e}"));
    let python = read(SYSTEM_PYTHON);
    let libc = read(SYSTEM_LIBC);
    let libstdcxx = read("/usr/lib/x86_64-linux-gnu/libstdc++.so.6");

    // The raw PT_LOAD program headers of a file, as `Phdr`s.
    let load_phdrs = |data: &[u8]| -> Vec<Phdr> {
        let file = object::read::elf::ElfFile64::<object::Endianness>::parse(data).expect("ELF64");
        let e = file.endian();
        file.elf_program_headers()
            .iter()
            .filter(|p| p.p_type(e) == object::elf::PT_LOAD)
            .map(|p| (1, p.p_flags(e), p.p_offset(e), p.p_vaddr(e), p.p_filesz(e), p.p_memsz(e)))
            .collect()
    };

    // python3.11: its program headers, .note.stapsdt, .stapsdt.base, and Py_Version in a section at its address.
    let file = object::File::parse(&*python).expect("python3.11");
    let notes = file.section_by_name(".note.stapsdt").expect("notes").data().expect("note bytes").to_vec();
    let base = file.section_by_name(".stapsdt.base").expect(".stapsdt.base").address();
    let version = file.dynamic_symbols().find(|s| s.name() == Ok("Py_Version")).expect("Py_Version");
    let version_bytes = file
        .section_by_index(version.section_index().expect("defined"))
        .expect("section")
        .data_range(version.address(), 4)
        .expect("range")
        .expect("in the file")
        .to_vec();
    let dynsym = [("Py_Version", 0x11, 3, version.address())];
    let sections = vec![
        section(".note.stapsdt", 7, 0, 0, notes),
        section(".stapsdt.base", 1, 2, base, vec![0]),
        section(".rodata", 1, 2, version.address(), version_bytes),
    ];
    let cut = build_elf64(&ElfSpec { dynsym: &dynsym, ..ElfSpec::new(62, &load_phdrs(&python), sections) });
    std::fs::write(dir.join("python3.11-usdt.elf"), cut).expect("write");

    // libc: its program headers and PT_INTERP, and 48 of its exported functions (plus hand-made oddities).
    let file = object::File::parse(&*libc).expect("libc");
    let text = file.section_by_name(".text").expect(".text");
    let mut exported: Vec<(String, u64)> = file
        .dynamic_symbols()
        .filter(|s| s.kind() == object::SymbolKind::Text && !s.is_undefined() && s.address() != 0)
        .filter_map(|s| Some((s.name().ok()?.to_owned(), s.address())))
        .filter(|(n, _)| n.starts_with("__libc_") || n.starts_with("pthread_"))
        .collect();
    exported.sort();
    exported.dedup_by(|a, b| a.0 == b.0);
    let step = (exported.len() / 48).max(1);
    let mut symbols: Vec<SymbolSpec> =
        exported.iter().step_by(step).take(48).map(|(n, a)| (n.as_str(), 0x12, 2, *a)).collect();
    let memcpy = file.dynamic_symbols().find(|s| s.name() == Ok("memcpy")).expect("memcpy").address();
    symbols.extend([
        ("memcpy@@GLIBC_2.14", 0x12, 2, memcpy),
        ("undefined_function", 0x12, 0, memcpy),
        ("zero_address", 0x12, 2, 0),
    ]);
    let mut phdrs = vec![(3, 4, 0, 0, 0, 0)];
    phdrs.extend(load_phdrs(&libc));
    let sections = vec![
        section(".interp", 1, 2, 0, b"/lib64/ld-linux-x86-64.so.2\0".to_vec()),
        section(".text", 8, 6, text.address(), Vec::new()),
    ];
    let cut = build_elf64(&ElfSpec { dynsym: &symbols, ..ElfSpec::new(62, &phdrs, sections) });
    std::fs::write(dir.join("libc-symbols.elf"), cut).expect("write");

    // Entry windows: 96 libc functions and 32 python3.11 ones, spread over each file's exports.
    let mut windows = Vec::new();
    for (data, count) in [(&libc, 96), (&python, 32)] {
        let syms = elf::function_symbols(data).expect("symbols");
        for s in syms.iter().step_by((syms.len() / count).max(1)).take(count) {
            let start = usize::try_from(s.file_offset).expect("offset");
            windows.extend(data.get(start..start + placement::WINDOW).expect("a window in the file"));
        }
    }
    std::fs::write(dir.join("entries.bin"), windows).expect("write");

    // Argument strings: python3.11's, and the forms the parser knows.
    let mut args: Vec<String> =
        usdt::parse_notes(&python).expect("notes").into_iter().map(|p| p.arguments).filter(|a| !a.is_empty()).collect();
    args.extend(
        [
            "-4@112(%rsp)",
            "8@-8(%rbp,%rax,8)",
            "8@0x10(,%rcx,4)",
            "8@(%rdi)",
            "4@$-1",
            "8@$0xffffffffffffffff",
            "2@%ax 1@%ah 1@%sil -2@%r9w 4@%r10d 1@%r11b",
            "8@counter(%rip)",
            "-4@counter+8(%rip)",
            "4@global",
            "8@$global+4",
            "8@.Lsym-0x8(%rip)",
        ]
        .map(String::from),
    );
    args.sort();
    args.dedup();
    std::fs::write(dir.join("usdt-args.txt"), args.join("\n") + "\n").expect("write");

    // Mangled names: 160 of libstdc++'s, and a few Rust ones.
    let file = object::File::parse(&*libstdcxx).expect("libstdc++");
    let mut names: Vec<String> = file
        .dynamic_symbols()
        .filter_map(|s| s.name().ok().filter(|n| n.starts_with("_Z")).map(str::to_owned))
        .collect();
    names.sort();
    names.dedup();
    let step = (names.len() / 160).max(1);
    let mut names: Vec<String> = names.into_iter().step_by(step).take(160).collect();
    names.extend(
        ["_ZN5myapp10train_step17h0123456789abcdefE", "_RNvCs1234_5myapp10train_step", "_ZN7Trainer4stepEv"]
            .map(String::from),
    );
    std::fs::write(dir.join("mangled-names.txt"), names.join("\n") + "\n").expect("write");
}

// ---------------------------------------------------------------------------------------------------------------
// Regressions: inputs the fuzzing found, shrunk, kept as named cases (proptest-regressions/ replays their seeds too,
// but only for as long as the strategies generate the same values from them).

/// `cpp_demangle` accepts bare type encodings: C symbols such as `DF32x`, `f` or `Ss` came back as `_Float32x`,
/// `float` and `std::string` (`near_matches` showed them, `report` named kernels so).
#[test]
fn regression_c_names_are_not_demangled_as_types() {
    for name in ["DF32x", "f", "i", "Ss", "Dn"] {
        assert_eq!(elf::demangled(name), name);
        assert_eq!(elf::demangled_full(name), None, "{name}");
        assert!(!elf::matches(name, "float"));
    }
    assert_eq!(elf::demangled("_Z1fv"), "f", "C++ names still demangle");
}

/// A `PT_LOAD` header whose `p_offset` plus a symbol's distance into the segment passes 2^64: an overflow panic in
/// debug builds, a wrapped (wrong) file offset in release builds. Now the symbol is outside the file: skipped.
#[test]
fn regression_segment_offset_past_2_pow_64() {
    const FUNC: u8 = 0x12;
    let t = BUILT_TEXT_ADDR;
    let symtab = [("inside", FUNC, 1, t + 0x10), ("wraps", FUNC, 1, t + 0x2000)];
    let phdrs = [(1, 5, u64::MAX - 0x1fff, t, 0x1000, 0x10_0000)];
    let sections = vec![section(".text", 8, 6, t, Vec::new())];
    let elf = build_elf64(&ElfSpec { symtab: &symtab, ..ElfSpec::new(62, &phdrs, sections) });
    let symbols = elf::function_symbols(&elf).expect("parses");
    let names: Vec<(&str, u64)> = symbols.iter().map(|s| (s.name.as_str(), s.file_offset)).collect();
    assert_eq!(names, vec![("inside", u64::MAX - 0x1fff + 0x10)]);
    check_symbols(&elf).expect("invariants");
    // The same segment holding a USDT probe: not mapped, an error rather than a wrapped offset.
    let notes = stapsdt_note(t + 0x2000, 0, 0, "app", "p", "");
    let mut phdrs = built_phdrs();
    phdrs[1] = (1, 5, u64::MAX - 0x1fff, t, 0x1000, 0x10_0000);
    let elf = build_elf64(&ElfSpec::new(62, &phdrs, vec![section(".note.stapsdt", 7, 0, 0, notes)]));
    assert!(matches!(usdt::parse_notes(&elf), Err(usdt::UsdtError::ProbeNotMapped { .. })));
}
