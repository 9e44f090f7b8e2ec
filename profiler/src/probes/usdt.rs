//! USDT (SystemTap SDT) probes of an ELF file: the `.note.stapsdt` notes, each
//! probe's file offset and its semaphore's, and the x86-64 argument specs
//! decoded into the `pt_regs` locations the eBPF side reads.
//!
//! No I/O here: callers hand in the file (bytes or parsed), so tests run on fixtures.
//! Attaching lives in [`attach`]; CPython's probes are `probes::python::usdt`'s.
pub mod attach;

use std::{collections::HashMap, fmt};

use object::{
    Endianness, Object, ObjectSymbol,
    elf::SHT_NOTE,
    endian::{U32, U64},
    read::elf::{ElfFile, FileHeader, SectionHeader},
};
use profiler_common::{USDT_MAX_ARGS, USDT_NO_REG, UsdtArgKind, UsdtArgSpec, UsdtProbeSpec};

use super::elf::load_segments;

/// `NT_STAPSDT`: the note type of SDT v3 probe descriptors (sys/sdt.h).
const NT_STAPSDT: u32 = 3;
const STAPSDT_OWNER: &[u8] = b"stapsdt";
const STAPSDT_BASE_SECTION: &[u8] = b".stapsdt.base";

/// One probe site as the notes describe it, with addresses corrected and
/// translated to file offsets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsdtProbe {
    pub provider: String,
    pub name: String,
    /// Address of the probe's `nop` in the file's own address space, corrected
    /// for prelinking with `.stapsdt.base`.
    pub address: u64,
    /// What the note says `.stapsdt.base` was at link time.
    pub note_base: u64,
    /// Address of the `unsigned short` semaphore (corrected like `address`);
    /// None when the probe has none and always fires.
    pub semaphore: Option<u64>,
    /// Offset of the probe in the file: what the uprobe PMU takes (`config2`).
    pub file_offset: u64,
    /// Offset of the semaphore in the file: the kernel's `ref_ctr_offset`, which
    /// it resolves through the file's writable mapping in each process.
    pub semaphore_file_offset: Option<u64>,
    /// The argument string as stored, e.g. `8@%rbp 8@%r12 -4@%eax`.
    pub arguments: String,
    /// The arguments decoded (x86-64 only); an error when the string holds a
    /// form this decoder cannot represent, which matters only to a caller that
    /// reads this probe's arguments.
    pub args: Result<Vec<UsdtArg>, ArgSpecError>,
}

impl UsdtProbe {
    /// The arguments in the `USDT_ARGS` map's layout.
    pub fn bpf_spec(&self) -> Result<UsdtProbeSpec, ArgSpecError> {
        let args = self.args.as_ref().map_err(Clone::clone)?;
        if args.len() > USDT_MAX_ARGS {
            return Err(ArgSpecError::TooMany { count: args.len(), max: USDT_MAX_ARGS });
        }
        let mut spec = UsdtProbeSpec { arg_count: args.len() as u32, ..Default::default() };
        for (slot, arg) in spec.args.iter_mut().zip(args) {
            *slot = arg.bpf_spec()?;
        }
        Ok(spec)
    }
}

impl fmt::Display for UsdtProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.provider, self.name)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UsdtError {
    /// The bytes are not an ELF file `object` can read.
    #[error("not a readable ELF file: {0}")]
    Parse(#[from] object::Error),
    /// A readable object file, but not ELF.
    #[error("not an ELF file")]
    NotElf,
    /// A `stapsdt` note too short for its addresses and three strings.
    #[error("malformed .note.stapsdt entry ({0})")]
    Malformed(&'static str),
    /// The probe's address is in no executable loadable segment.
    #[error("USDT probe {probe} at {address:#x} is not in an executable segment")]
    ProbeNotMapped { probe: String, address: u64 },
    /// The semaphore's address is in no writable loadable segment.
    #[error("semaphore of USDT probe {probe} at {address:#x} is not in a writable segment")]
    SemaphoreNotMapped { probe: String, address: u64 },
}

/// Why an argument string cannot be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArgSpecError {
    #[error("argument '{0}' has no size prefix (N@): pre-v3 SDT notes are not supported")]
    NoSize(String),
    #[error("argument '{arg}': size {size} is not one of ±1, ±2, ±4, ±8")]
    BadSize { arg: String, size: String },
    #[error("argument '{arg}': unknown x86-64 register %{reg}")]
    UnknownRegister { arg: String, reg: String },
    #[error("argument '{arg}': cannot parse {what}")]
    Syntax { arg: String, what: &'static str },
    #[error(
        "argument '{arg}': a numeric %rip-relative operand refers to the instruction after a `nop`, which is meaningless"
    )]
    NumericRipRelative { arg: String },
    #[error("argument '{arg}': symbol '{symbol}' is not in the file's symbol tables (stripped?)")]
    UnknownSymbol { arg: String, symbol: String },
    #[error("argument '{arg}': a symbolic operand must be resolved against the file's symbols first")]
    Unresolved { arg: String },
    #[error("{count} arguments, more than the {max} the eBPF side keeps")]
    TooMany { count: usize, max: usize },
    #[error("USDT arguments are decoded for x86-64 only, this file is for ELF machine {0}")]
    UnsupportedMachine(u16),
}

/// An x86-64 general-purpose register as an argument names it (`%eax` is
/// the low 4 bytes of `rax`, `%ah` byte 1 of it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Register {
    /// The full 64-bit register's name, e.g. `rax` for `%al`.
    pub full: &'static str,
    /// Byte offset of the full register in the x86-64 `struct pt_regs`.
    pub pt_regs_offset: u32,
    /// Byte where the named part starts: 1 for `%ah` `%bh` `%ch` `%dh`, else 0.
    pub byte: u32,
}

impl Register {
    /// The `pt_regs` offset the eBPF side reads 8 bytes from: reading one byte
    /// further makes `%ah` the low byte.
    pub fn read_offset(self) -> u32 {
        self.pt_regs_offset + self.byte
    }
}

/// `pt_regs` of x86-64 (arch/x86/include/asm/ptrace.h), by full register name.
const PT_REGS: [(&str, u32); 21] = [
    ("r15", 0),
    ("r14", 8),
    ("r13", 16),
    ("r12", 24),
    ("rbp", 32),
    ("rbx", 40),
    ("r11", 48),
    ("r10", 56),
    ("r9", 64),
    ("r8", 72),
    ("rax", 80),
    ("rcx", 88),
    ("rdx", 96),
    ("rsi", 104),
    ("rdi", 112),
    ("orig_rax", 120),
    ("rip", 128),
    ("cs", 136),
    ("eflags", 144),
    ("rsp", 152),
    ("ss", 160),
];

/// The register a (`%`-less) AT&T name denotes, in any of its widths.
pub fn register(name: &str) -> Option<Register> {
    let lower = name.to_ascii_lowercase();
    let (full, byte): (String, u32) = match lower.as_str() {
        // The legacy eight: rax / eax / ax / al / ah, rsi / esi / si / sil, …
        "rax" | "eax" | "ax" | "al" => ("rax".into(), 0),
        "rbx" | "ebx" | "bx" | "bl" => ("rbx".into(), 0),
        "rcx" | "ecx" | "cx" | "cl" => ("rcx".into(), 0),
        "rdx" | "edx" | "dx" | "dl" => ("rdx".into(), 0),
        "ah" => ("rax".into(), 1),
        "bh" => ("rbx".into(), 1),
        "ch" => ("rcx".into(), 1),
        "dh" => ("rdx".into(), 1),
        "rsi" | "esi" | "si" | "sil" => ("rsi".into(), 0),
        "rdi" | "edi" | "di" | "dil" => ("rdi".into(), 0),
        "rbp" | "ebp" | "bp" | "bpl" => ("rbp".into(), 0),
        "rsp" | "esp" | "sp" | "spl" => ("rsp".into(), 0),
        "rip" | "eip" => ("rip".into(), 0),
        // r8..r15 with the d / w / b (or Intel's l) suffixes.
        s if s.starts_with('r') => {
            let digits: String = s[1..].chars().take_while(char::is_ascii_digit).collect();
            let rest = &s[1 + digits.len()..];
            let n: u32 = digits.parse().ok()?;
            if !(8..=15).contains(&n) || !matches!(rest, "" | "d" | "w" | "b" | "l") {
                return None;
            }
            (format!("r{n}"), 0)
        }
        _ => return None,
    };
    let &(full, offset) = PT_REGS.iter().find(|(n, _)| *n == full)?;
    Some(Register { full, pt_regs_offset: offset, byte })
}

/// Where an argument's value is at the probe site.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArgLocation {
    /// `$CONST`.
    Constant(i64),
    /// `%reg`.
    Register(Register),
    /// `DISP(%base,%index,scale)`: user memory at base + index·scale + DISP.
    /// After symbol resolution a `sym(%rip)` operand is one of these too, with
    /// base `%rip` (which holds the probe's address when it fires).
    Memory { base: Option<Register>, index: Option<(Register, u8)>, displacement: i64 },
    /// The value is `base + displacement`, no memory read: a resolved
    /// `$sym` (a symbol's address as a constant), relative to `%rip`.
    Address { base: Register, displacement: i64 },
    /// `sym±N(%rip)` or an absolute `sym±N` (`deref`: the value is in memory
    /// there), or `$sym±N` (the address itself), before resolution.
    Symbol { symbol: String, addend: i64, deref: bool },
}

/// One decoded argument.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsdtArg {
    /// Width in bytes: 1, 2, 4 or 8.
    pub size: u8,
    pub signed: bool,
    pub location: ArgLocation,
    /// The argument as written, for messages.
    pub text: String,
}

impl UsdtArg {
    /// This argument in the `USDT_ARGS` map's layout.
    pub fn bpf_spec(&self) -> Result<UsdtArgSpec, ArgSpecError> {
        let mut spec = UsdtArgSpec {
            kind: UsdtArgKind::None as u32,
            size: self.size.into(),
            signed: self.signed.into(),
            reg_offset: USDT_NO_REG,
            index_offset: USDT_NO_REG,
            scale: 1,
            displacement: 0,
        };
        match &self.location {
            ArgLocation::Constant(v) => {
                spec.kind = UsdtArgKind::Constant as u32;
                spec.displacement = *v;
            }
            ArgLocation::Register(r) => {
                spec.kind = UsdtArgKind::Register as u32;
                spec.reg_offset = r.read_offset();
            }
            ArgLocation::Address { base, displacement } => {
                spec.kind = UsdtArgKind::Register as u32;
                spec.reg_offset = base.read_offset();
                spec.displacement = *displacement;
            }
            ArgLocation::Memory { base, index, displacement } => {
                spec.kind = UsdtArgKind::Memory as u32;
                spec.reg_offset = base.map_or(USDT_NO_REG, Register::read_offset);
                if let Some((r, scale)) = index {
                    spec.index_offset = r.read_offset();
                    spec.scale = (*scale).into();
                }
                spec.displacement = *displacement;
            }
            ArgLocation::Symbol { .. } => return Err(ArgSpecError::Unresolved { arg: self.text.clone() }),
        }
        Ok(spec)
    }
}

/// Decodes an x86-64 argument string (GNU as AT&T operands with a size
/// prefix, space separated): `N@%reg`, `N@$CONST`, `N@DISP(%base)`,
/// `N@(%base,%index,scale)`, `N@sym+OFF(%rip)`, `N@sym`, `N@$sym`; a negative N
/// is signed.
/// Symbolic operands come back as [`ArgLocation::Symbol`].
pub fn parse_arguments(spec: &str) -> Result<Vec<UsdtArg>, ArgSpecError> {
    spec.split_ascii_whitespace().map(parse_argument).collect()
}

fn parse_argument(text: &str) -> Result<UsdtArg, ArgSpecError> {
    let syntax = |what| ArgSpecError::Syntax { arg: text.to_owned(), what };
    let Some((size_text, operand)) = text.split_once('@') else {
        return Err(ArgSpecError::NoSize(text.to_owned()));
    };
    let (signed, size) = match size_text.parse::<i8>() {
        Ok(n @ (1 | 2 | 4 | 8)) => (false, n as u8),
        Ok(n @ (-1 | -2 | -4 | -8)) => (true, n.unsigned_abs()),
        _ => return Err(ArgSpecError::BadSize { arg: text.to_owned(), size: size_text.to_owned() }),
    };
    let reg = |name: &str| {
        register(name).ok_or_else(|| ArgSpecError::UnknownRegister { arg: text.to_owned(), reg: name.to_owned() })
    };
    let location = if let Some(c) = operand.strip_prefix('$') {
        match parse_displacement(c) {
            Some(Displacement::Number(n)) => ArgLocation::Constant(n),
            // Non-PIC code passes addresses as `$symbol`.
            Some(Displacement::Symbol(symbol, addend)) => ArgLocation::Symbol { symbol, addend, deref: false },
            None => return Err(syntax("the constant")),
        }
    } else if let Some(r) = operand.strip_prefix('%') {
        ArgLocation::Register(reg(r)?)
    } else {
        // A memory operand: DISP(...) or DISP alone (an absolute address).
        let (disp, inner) = match operand.split_once('(') {
            Some((d, rest)) => (d, Some(rest.strip_suffix(')').ok_or_else(|| syntax("the memory operand"))?)),
            None => (operand, None),
        };
        let parts: Vec<&str> = inner.map(|i| i.split(',').map(str::trim).collect()).unwrap_or_default();
        let named = |p: &str| -> Result<Option<Register>, ArgSpecError> {
            match p {
                "" => Ok(None),
                p => Ok(Some(reg(p.strip_prefix('%').ok_or_else(|| syntax("a register"))?)?)),
            }
        };
        let base = match parts.first() {
            Some(p) => named(p)?,
            None => None,
        };
        let index = match (parts.get(1), parts.get(2)) {
            (None, None) => None,
            (Some(i), scale) => {
                let scale: u8 = match scale {
                    None => 1,
                    Some(s) => {
                        s.parse().ok().filter(|s| matches!(s, 1 | 2 | 4 | 8)).ok_or_else(|| syntax("the scale"))?
                    }
                };
                named(i)?.map(|r| (r, scale))
            }
            (None, Some(_)) => return Err(syntax("the memory operand")),
        };
        if parts.len() > 3 {
            return Err(syntax("the memory operand"));
        }
        let rip_relative = base.is_some_and(|b| b.full == "rip");
        if rip_relative && index.is_some() {
            return Err(syntax("the memory operand"));
        }
        match parse_displacement(disp) {
            Some(Displacement::Number(_)) if rip_relative => {
                return Err(ArgSpecError::NumericRipRelative { arg: text.to_owned() });
            }
            Some(Displacement::Number(n)) => ArgLocation::Memory { base, index, displacement: n },
            // `sym(%rip)` and a bare `sym` both name the symbol's address.
            Some(Displacement::Symbol(symbol, addend)) if (base.is_none() && index.is_none()) || rip_relative => {
                ArgLocation::Symbol { symbol, addend, deref: true }
            }
            Some(Displacement::Symbol(..)) => return Err(syntax("a symbol combined with registers")),
            None => return Err(syntax("the displacement")),
        }
    };
    Ok(UsdtArg { size, signed, location, text: text.to_owned() })
}

enum Displacement {
    Number(i64),
    Symbol(String, i64),
}

/// `""` (0), `-16`, `0x10`, `sym`, `sym+8`, `sym-0x8`.
fn parse_displacement(s: &str) -> Option<Displacement> {
    if s.is_empty() {
        return Some(Displacement::Number(0));
    }
    if let Some(n) = parse_int(s) {
        return Some(Displacement::Number(n));
    }
    // A symbol starts with a letter, `_` or `.`; an addend follows the last +/-.
    let first = s.chars().next()?;
    if !(first.is_ascii_alphabetic() || first == '_' || first == '.') {
        return None;
    }
    match s.rfind(['+', '-']) {
        Some(i) if i > 0 => {
            let (sym, addend) = s.split_at(i);
            let addend = parse_int(addend.strip_prefix('+').unwrap_or(addend))?;
            Some(Displacement::Symbol(sym.to_owned(), addend))
        }
        _ => Some(Displacement::Symbol(s.to_owned(), 0)),
    }
}

/// A decimal or `0x` hexadecimal integer, optionally negative.
fn parse_int(s: &str) -> Option<i64> {
    let (neg, digits) = match s.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let magnitude = match digits.strip_prefix("0x").or_else(|| digits.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok()?,
        None if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => digits.parse::<u64>().ok()?,
        None => return None,
    };
    // Two's complement: constants like $0xffffffffffffffff are legitimate.
    let v = magnitude as i64;
    Some(if neg { v.wrapping_neg() } else { v })
}

/// Turns symbolic operands into operands relative to `%rip`: when the probe
/// fires the kernel has set `%rip` to the probe's address, so the symbol's
/// run-time address is `%rip + (symbol − probe address)` for executables and
/// shared libraries alike, with no load bias to know.
fn resolve_symbols(
    args: Vec<UsdtArg>,
    probe_address: u64,
    lookup: &mut impl FnMut(&str) -> Option<u64>,
) -> Result<Vec<UsdtArg>, ArgSpecError> {
    args.into_iter()
        .map(|mut arg| {
            if let ArgLocation::Symbol { symbol, addend, deref } = &arg.location {
                let Some(addr) = lookup(symbol) else {
                    return Err(ArgSpecError::UnknownSymbol { arg: arg.text.clone(), symbol: symbol.clone() });
                };
                let rip = register("rip").ok_or_else(|| ArgSpecError::Unresolved { arg: arg.text.clone() })?;
                let displacement = (addr as i64).wrapping_add(*addend).wrapping_sub(probe_address as i64);
                arg.location = if *deref {
                    ArgLocation::Memory { base: Some(rip), index: None, displacement }
                } else {
                    ArgLocation::Address { base: rip, displacement }
                };
            }
            Ok(arg)
        })
        .collect()
}

/// Every USDT probe in `data`'s `.note.stapsdt` notes (none: an empty list).
#[cfg(test)]
pub fn parse_notes(data: &[u8]) -> Result<Vec<UsdtProbe>, UsdtError> {
    notes(&object::File::parse(data)?)
}

/// Every USDT probe in `file`'s `.note.stapsdt` notes (none: an empty list).
/// The caller parses the file, and may read more of it.
pub fn notes(file: &object::File<'_>) -> Result<Vec<UsdtProbe>, UsdtError> {
    match file {
        object::File::Elf32(f) => elf_notes(f),
        object::File::Elf64(f) => elf_notes(f),
        _ => Err(UsdtError::NotElf),
    }
}

/// The probes named `provider:name` (a probe may have several sites).
pub fn find<'a>(probes: &'a [UsdtProbe], provider: &str, name: &str) -> impl Iterator<Item = &'a UsdtProbe> {
    probes.iter().filter(move |p| p.provider == provider && p.name == name)
}

fn elf_notes<'data, Elf: FileHeader<Endian = Endianness>>(
    file: &ElfFile<'data, Elf>,
) -> Result<Vec<UsdtProbe>, UsdtError> {
    let (endian, data) = (file.endian(), file.data());
    let sections = file.elf_section_table();
    let segments = load_segments(file);
    let base_section: Option<u64> =
        sections.section_by_name(endian, STAPSDT_BASE_SECTION).map(|(_, s)| s.sh_addr(endian).into());
    let machine = file.elf_header().e_machine(endian);
    let is_64 = file.elf_header().is_class_64();

    // Symbols are only needed for `sym(%rip)` operands, which are rare: indexed
    // on first use, `.symtab` before `.dynsym`.
    let mut symbols: Option<HashMap<&'data str, u64>> = None;
    let mut lookup = |name: &str| -> Option<u64> {
        let table = symbols.get_or_insert_with(|| {
            let mut table = HashMap::new();
            for s in file.symbols().chain(file.dynamic_symbols()).filter(|s| !s.is_undefined()) {
                if let Ok(n) = s.name() {
                    table.entry(n).or_insert(s.address());
                }
            }
            table
        });
        table.get(name).copied()
    };

    let mut out = Vec::new();
    for section in sections.iter().filter(|s| s.sh_type(endian) == SHT_NOTE) {
        let Some(mut notes) = section.notes(endian, data)? else { continue };
        while let Some(note) = notes.next()? {
            if note.name() != STAPSDT_OWNER || note.n_type(endian) != NT_STAPSDT {
                continue;
            }
            let raw = parse_desc(note.desc(), is_64, endian)?;
            // Prelinking moves the file without rewriting the notes (they are
            // not loaded), but it moves `.stapsdt.base` with everything else:
            // the difference is how far every address in the note moved. libbpf
            // and SystemTap correct the probe address this way; the semaphore
            // lives in the same image and moved by the same amount.
            let delta = match base_section {
                Some(now) if raw.base != 0 => now.wrapping_sub(raw.base),
                _ => 0,
            };
            let placed = place(&segments, &raw, delta)?;
            let address = placed.address;
            let args = if machine == object::elf::EM_X86_64 {
                parse_arguments(&raw.args).and_then(|a| resolve_symbols(a, address, &mut lookup))
            } else {
                Err(ArgSpecError::UnsupportedMachine(machine))
            };
            out.push(UsdtProbe {
                provider: raw.provider,
                name: raw.name,
                address,
                note_base: raw.base,
                semaphore: placed.semaphore,
                file_offset: placed.file_offset,
                semaphore_file_offset: placed.semaphore_file_offset,
                arguments: raw.args,
                args,
            });
        }
    }
    Ok(out)
}

/// Where a note's probe and semaphore are, in memory and in the file.
struct Placed {
    address: u64,
    semaphore: Option<u64>,
    file_offset: u64,
    semaphore_file_offset: Option<u64>,
}

/// The probe's and semaphore's addresses moved by `delta` (prelinking), and
/// their offsets in the file.
fn place(segments: &[super::elf::LoadSegment], raw: &RawNote, delta: u64) -> Result<Placed, UsdtError> {
    let address = raw.pc.wrapping_add(delta);
    let semaphore = (raw.semaphore != 0).then(|| raw.semaphore.wrapping_add(delta));
    let label = format!("{}:{}", raw.provider, raw.name);
    // The probe is code; the semaphore is data, which the kernel
    // finds through the file's writable mapping in each process.
    let file_offset = segments
        .iter()
        .filter(|s| s.executable())
        .find_map(|s| s.file_offset(address))
        .ok_or_else(|| UsdtError::ProbeNotMapped { probe: label.clone(), address })?;
    let semaphore_file_offset = match semaphore {
        Some(a) => Some(
            segments
                .iter()
                .filter(|s| !s.executable())
                .find_map(|s| s.file_offset(a))
                .ok_or(UsdtError::SemaphoreNotMapped { probe: label, address: a })?,
        ),
        None => None,
    };
    Ok(Placed { address, semaphore, file_offset, semaphore_file_offset })
}

struct RawNote {
    pc: u64,
    base: u64,
    semaphore: u64,
    provider: String,
    name: String,
    args: String,
}

/// The descriptor: three addresses (pc, base, semaphore) of the file's class,
/// then provider, name and argument string, each NUL-terminated.
fn parse_desc(desc: &[u8], is_64: bool, endian: Endianness) -> Result<RawNote, UsdtError> {
    let short = || UsdtError::Malformed("descriptor shorter than its three addresses");
    let ([pc, base, semaphore], strings) = if is_64 {
        let (a, rest) = object::pod::from_bytes::<[U64<Endianness>; 3]>(desc).map_err(|()| short())?;
        (a.map(|v| v.get(endian)), rest)
    } else {
        let (a, rest) = object::pod::from_bytes::<[U32<Endianness>; 3]>(desc).map_err(|()| short())?;
        (a.map(|v| u64::from(v.get(endian))), rest)
    };
    // Three strings need three NULs: then splitting yields a fourth piece.
    let pieces: Vec<&[u8]> = strings.splitn(4, |&b| b == 0).collect();
    let [provider, name, args, _] = pieces[..] else {
        return Err(UsdtError::Malformed("strings not NUL-terminated"));
    };
    if provider.is_empty() || name.is_empty() {
        return Err(UsdtError::Malformed("empty provider or probe name"));
    }
    let text = |s: &[u8]| String::from_utf8_lossy(s).into_owned();
    Ok(RawNote { pc, base, semaphore, provider: text(provider), name: text(name), args: text(args) })
}

#[cfg(test)]
mod tests;
