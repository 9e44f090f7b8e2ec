//! Note and argument-spec parsing on hand-built ELF files and on Debian's
//! python3.11 (when installed).
use object::{Object, ObjectSection};

use super::*;

fn reg(name: &str) -> Register {
    register(name).unwrap_or_else(|| panic!("register {name}"))
}

fn one(spec: &str) -> UsdtArg {
    let mut args = parse_arguments(spec).unwrap_or_else(|e| panic!("{spec}: {e}"));
    assert_eq!(args.len(), 1, "{spec}");
    args.remove(0)
}

#[test]
fn register_names_map_to_pt_regs_offsets() {
    let cases: &[(&str, u32, u32)] = &[
        ("r15", 0, 0),
        ("r14d", 8, 0),
        ("r13w", 16, 0),
        ("r12b", 24, 0),
        ("rbp", 32, 0),
        ("ebp", 32, 0),
        ("bpl", 32, 0),
        ("rbx", 40, 0),
        ("bl", 40, 0),
        ("bh", 40, 1),
        ("r11", 48, 0),
        ("r10d", 56, 0),
        ("r9", 64, 0),
        ("r8d", 72, 0),
        ("r8l", 72, 0),
        ("rax", 80, 0),
        ("eax", 80, 0),
        ("ax", 80, 0),
        ("al", 80, 0),
        ("ah", 80, 1),
        ("ecx", 88, 0),
        ("ch", 88, 1),
        ("dx", 96, 0),
        ("sil", 104, 0),
        ("esi", 104, 0),
        ("di", 112, 0),
        ("rip", 128, 0),
        ("rsp", 152, 0),
        ("spl", 152, 0),
        ("EAX", 80, 0),
    ];
    for &(name, offset, byte) in cases {
        let r = reg(name);
        assert_eq!((r.pt_regs_offset, r.byte), (offset, byte), "%{name}");
    }
    for bad in ["r16", "r7", "xmm0", "eflags", "r8x", "", "r"] {
        assert_eq!(register(bad), None, "%{bad}");
    }
}

#[test]
fn cpython_argument_specs() {
    let args = parse_arguments("8@%rbp 8@%r12 -4@%eax").expect("parse");
    let got: Vec<(u8, bool, ArgLocation)> = args.into_iter().map(|a| (a.size, a.signed, a.location)).collect();
    assert_eq!(
        got,
        vec![
            (8, false, ArgLocation::Register(reg("rbp"))),
            (8, false, ArgLocation::Register(reg("r12"))),
            (4, true, ArgLocation::Register(reg("eax"))),
        ]
    );
    // gc__start in the same binary: a stack slot.
    assert_eq!(
        one("-4@112(%rsp)").location,
        ArgLocation::Memory { base: Some(reg("rsp")), index: None, displacement: 112 }
    );
    assert_eq!(parse_arguments("").expect("no arguments"), vec![]);
}

#[test]
fn memory_operands_in_every_form() {
    let mem = |base: Option<&str>, index: Option<(&str, u8)>, displacement| ArgLocation::Memory {
        base: base.map(reg),
        index: index.map(|(r, s)| (reg(r), s)),
        displacement,
    };
    assert_eq!(one("-4@-20(%rbp)").location, mem(Some("rbp"), None, -20));
    assert_eq!(one("8@(%rsp)").location, mem(Some("rsp"), None, 0));
    assert_eq!(one("2@0x10(%r8)").location, mem(Some("r8"), None, 16));
    assert_eq!(one("-8@-0x10(%rdi)").location, mem(Some("rdi"), None, -16));
    assert_eq!(one("8@8(%rax,%rbx,8)").location, mem(Some("rax"), Some(("rbx", 8)), 8));
    assert_eq!(one("4@(%rax,%rcx)").location, mem(Some("rax"), Some(("rcx", 1)), 0));
    assert_eq!(one("4@16(,%rcx,4)").location, mem(None, Some(("rcx", 4)), 16));
    assert_eq!(one("4@0x601040").location, mem(None, None, 0x601040));
    let a = one("1@3(%r9d)");
    assert_eq!((a.size, a.signed), (1, false));
}

#[test]
fn constants_and_signedness() {
    let c = one("4@$5");
    assert_eq!((c.size, c.signed, c.location), (4, false, ArgLocation::Constant(5)));
    let c = one("-1@$-1");
    assert_eq!((c.size, c.signed, c.location), (1, true, ArgLocation::Constant(-1)));
    assert_eq!(one("8@$0x10").location, ArgLocation::Constant(16));
    assert_eq!(one("-8@$0xffffffffffffffff").location, ArgLocation::Constant(-1));
    let a = one("-2@%ax");
    assert_eq!((a.size, a.signed), (2, true));
}

#[test]
fn symbolic_operands_wait_for_resolution() {
    let sym = |s: &str, addend| ArgLocation::Symbol { symbol: s.into(), addend, deref: true };
    assert_eq!(one("8@counter(%rip)").location, sym("counter", 0));
    assert_eq!(one("4@counter+8(%rip)").location, sym("counter", 8));
    assert_eq!(one("4@_ZL5state-0x4(%rip)").location, sym("_ZL5state", -4));
    assert_eq!(one("8@.LC0(%rip)").location, sym(".LC0", 0));
    assert_eq!(one("-4@global_int").location, sym("global_int", 0));
    // Non-PIC code passes an address as a symbolic constant.
    assert_eq!(one("8@$.LC1").location, ArgLocation::Symbol { symbol: ".LC1".into(), addend: 0, deref: false });
    assert_eq!(one("8@$table+16").location, ArgLocation::Symbol { symbol: "table".into(), addend: 16, deref: false });
    let err = one("8@counter(%rip)").bpf_spec().expect_err("unresolved");
    assert!(matches!(err, ArgSpecError::Unresolved { .. }));
}

#[test]
fn unsupported_forms_are_clear_errors() {
    let err = |spec: &str| parse_arguments(spec).expect_err(spec);
    assert_eq!(err("%eax"), ArgSpecError::NoSize("%eax".into()));
    assert!(matches!(err("3@%eax"), ArgSpecError::BadSize { .. }));
    assert!(matches!(err("16@%rax"), ArgSpecError::BadSize { .. }));
    assert!(matches!(err("x@%rax"), ArgSpecError::BadSize { .. }));
    assert!(matches!(err("8@%xmm0"), ArgSpecError::UnknownRegister { reg, .. } if reg == "xmm0"));
    assert!(matches!(err("8@8(%zz)"), ArgSpecError::UnknownRegister { .. }));
    assert!(matches!(err("8@0x10(%rip)"), ArgSpecError::NumericRipRelative { .. }));
    assert!(matches!(err("8@(%rax"), ArgSpecError::Syntax { .. }));
    assert!(matches!(err("8@$1abc"), ArgSpecError::Syntax { .. }));
    assert!(matches!(err("8@$-x"), ArgSpecError::Syntax { .. }));
    assert!(matches!(err("8@(%rax,%rbx,3)"), ArgSpecError::Syntax { .. }));
    assert!(matches!(err("8@sym(%rax)"), ArgSpecError::Syntax { .. }));
    assert!(matches!(err("8@(%rax,%rbx,8,1)"), ArgSpecError::Syntax { .. }));
    assert!(matches!(err("8@(rax)"), ArgSpecError::Syntax { .. }));
    // One bad argument spoils the probe, whatever its position.
    assert!(matches!(err("8@%rbp 8@%bogus -4@%eax"), ArgSpecError::UnknownRegister { .. }));
    // Every error names the argument.
    assert!(err("4@%foo").to_string().contains("'4@%foo'"));
}

#[test]
fn bpf_specs_encode_offsets_sizes_and_signs() {
    let s = one("-4@%eax").bpf_spec().expect("spec");
    assert_eq!(
        s,
        UsdtArgSpec {
            kind: UsdtArgKind::Register as u32,
            size: 4,
            signed: 1,
            reg_offset: 80,
            index_offset: USDT_NO_REG,
            scale: 1,
            displacement: 0
        }
    );
    // %ah: the byte above %al, read one byte into rax's slot.
    assert_eq!(one("1@%ah").bpf_spec().expect("spec").reg_offset, 81);
    let s = one("8@-24(%rbx,%r13,4)").bpf_spec().expect("spec");
    assert_eq!(
        (s.kind, s.reg_offset, s.index_offset, s.scale, s.displacement),
        (UsdtArgKind::Memory as u32, 40, 16, 4, -24)
    );
    let s = one("4@16(,%rcx,2)").bpf_spec().expect("spec");
    assert_eq!((s.reg_offset, s.index_offset, s.scale), (USDT_NO_REG, 88, 2));
    let s = one("-2@$-300").bpf_spec().expect("spec");
    assert_eq!((s.kind, s.size, s.signed, s.displacement), (UsdtArgKind::Constant as u32, 2, 1, -300));
}

/// A hand-built little-endian x86-64 ELF: an executable segment, a writable
/// segment whose file offset differs from its address, `.note.stapsdt`,
/// optionally `.stapsdt.base` and a symbol table.
struct ElfFixture {
    machine: u16,
    notes: Vec<u8>,
    stapsdt_base: Option<u64>,
    symbols: Vec<(&'static str, u64)>,
}

const TEXT_ADDR: u64 = 0x40_1000;
const TEXT_OFF: u64 = 0x1000;
const TEXT_SIZE: u64 = 0x1000;
const DATA_ADDR: u64 = 0x60_3000;
const DATA_OFF: u64 = 0x2000;
const DATA_FILESZ: u64 = 0x100;
const DATA_MEMSZ: u64 = 0x800;

fn note(pc: u64, base: u64, semaphore: u64, provider: &str, name: &str, args: &str) -> Vec<u8> {
    let mut desc = Vec::new();
    for a in [pc, base, semaphore] {
        desc.extend_from_slice(&a.to_le_bytes());
    }
    for s in [provider, name, args] {
        desc.extend_from_slice(s.as_bytes());
        desc.push(0);
    }
    raw_note(b"stapsdt\0", 3, &desc)
}

fn raw_note(owner: &[u8], kind: u32, desc: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(owner.len() as u32).to_le_bytes());
    out.extend_from_slice(&(desc.len() as u32).to_le_bytes());
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(owner);
    out.resize(out.len().next_multiple_of(4), 0);
    out.extend_from_slice(desc);
    out.resize(out.len().next_multiple_of(4), 0);
    out
}

/// A section header's fields, and the section's bytes.
struct Section {
    name: &'static str,
    kind: u32,
    flags: u64,
    addr: u64,
    bytes: Vec<u8>,
    link: u32,
    info: u32,
    entsize: u64,
}

impl ElfFixture {
    fn new(notes: Vec<Vec<u8>>) -> Self {
        Self { machine: 62, notes: notes.concat(), stapsdt_base: None, symbols: Vec::new() }
    }

    fn build(&self) -> Vec<u8> {
        let mut f = vec![0u8; (DATA_OFF + DATA_FILESZ) as usize];
        // Every text byte is a nop, as probe sites are; the test checks offsets
        // through section contents anyway.
        f[TEXT_OFF as usize..(TEXT_OFF + TEXT_SIZE) as usize].fill(0x90);
        let section =
            |name, kind, flags, addr, bytes| Section { name, kind, flags, addr, bytes, link: 0, info: 0, entsize: 0 };
        let mut sections = vec![section(".note.stapsdt", 7, 0, 0, self.notes.clone())];
        if let Some(base) = self.stapsdt_base {
            sections.push(section(".stapsdt.base", 1, 2, base, vec![0]));
        }
        if !self.symbols.is_empty() {
            let mut strtab = vec![0u8];
            let mut symtab = vec![0u8; 24];
            for (name, addr) in &self.symbols {
                let name_off = strtab.len() as u32;
                strtab.extend_from_slice(name.as_bytes());
                strtab.push(0);
                symtab.extend_from_slice(&name_off.to_le_bytes());
                symtab.push(0x11); // STB_GLOBAL, STT_OBJECT
                symtab.push(0);
                symtab.extend_from_slice(&1u16.to_le_bytes()); // any defined section
                symtab.extend_from_slice(&addr.to_le_bytes());
                symtab.extend_from_slice(&8u64.to_le_bytes());
            }
            let strtab_index = sections.len() as u32 + 2; // after symtab, counting the null section
            sections.push(Section { link: strtab_index, info: 1, entsize: 24, ..section(".symtab", 2, 0, 0, symtab) });
            sections.push(section(".strtab", 3, 0, 0, strtab));
        }
        let mut shstrtab = vec![0u8];
        let mut names = Vec::new();
        for s in &sections {
            names.push(shstrtab.len() as u32);
            shstrtab.extend_from_slice(s.name.as_bytes());
            shstrtab.push(0);
        }
        let shstrtab_name = shstrtab.len() as u32;
        shstrtab.extend_from_slice(b".shstrtab\0");
        sections.push(section(".shstrtab", 3, 0, 0, shstrtab));
        names.push(shstrtab_name);

        let mut headers = vec![0u8; 64]; // the null section header
        for (s, name) in sections.iter().zip(&names) {
            f.resize(f.len().next_multiple_of(8), 0);
            let offset = f.len() as u64;
            f.extend_from_slice(&s.bytes);
            headers.extend_from_slice(&name.to_le_bytes());
            headers.extend_from_slice(&s.kind.to_le_bytes());
            headers.extend_from_slice(&s.flags.to_le_bytes());
            headers.extend_from_slice(&s.addr.to_le_bytes());
            headers.extend_from_slice(&offset.to_le_bytes());
            headers.extend_from_slice(&(s.bytes.len() as u64).to_le_bytes());
            headers.extend_from_slice(&s.link.to_le_bytes());
            headers.extend_from_slice(&s.info.to_le_bytes());
            headers.extend_from_slice(&1u64.to_le_bytes());
            headers.extend_from_slice(&s.entsize.to_le_bytes());
        }
        f.resize(f.len().next_multiple_of(8), 0);
        let shoff = f.len() as u64;
        f.extend_from_slice(&headers);

        // ELF header.
        let mut h = vec![0x7f, b'E', b'L', b'F', 2, 1, 1, 0];
        h.resize(16, 0);
        h.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
        h.extend_from_slice(&self.machine.to_le_bytes());
        h.extend_from_slice(&1u32.to_le_bytes());
        h.extend_from_slice(&TEXT_ADDR.to_le_bytes()); // e_entry
        h.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
        h.extend_from_slice(&shoff.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        for v in [64u16, 56, 2, 64, sections.len() as u16 + 1, sections.len() as u16] {
            h.extend_from_slice(&v.to_le_bytes());
        }
        // Program headers: R+X text, RW data.
        for (flags, off, addr, filesz, memsz) in
            [(5u32, TEXT_OFF, TEXT_ADDR, TEXT_SIZE, TEXT_SIZE), (6, DATA_OFF, DATA_ADDR, DATA_FILESZ, DATA_MEMSZ)]
        {
            h.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
            h.extend_from_slice(&flags.to_le_bytes());
            for v in [off, addr, addr, filesz, memsz, 0x1000] {
                h.extend_from_slice(&v.to_le_bytes());
            }
        }
        f[..h.len()].copy_from_slice(&h);
        f
    }
}

#[test]
fn notes_give_file_offsets_of_probe_and_semaphore() {
    let elf = ElfFixture::new(vec![
        note(TEXT_ADDR + 0x10, 0, DATA_ADDR + 0x40, "app", "step__start", "-4@%edi 8@%rsi"),
        note(TEXT_ADDR + 0x20, 0, 0, "app", "step__done", ""),
        // Other owners' notes in the same section are skipped.
        raw_note(b"GNU\0", 3, &[0; 16]),
        // A semaphore in the zero-filled tail of the data segment.
        note(TEXT_ADDR + 0x30, 0, DATA_ADDR + 0x500, "app", "late", "4@$1"),
    ])
    .build();
    let probes = parse_notes(&elf).expect("parse");
    assert_eq!(probes.len(), 3);
    let start = &probes[0];
    assert_eq!((start.provider.as_str(), start.name.as_str()), ("app", "step__start"));
    assert_eq!(start.to_string(), "app:step__start");
    assert_eq!(start.address, TEXT_ADDR + 0x10);
    assert_eq!(start.file_offset, TEXT_OFF + 0x10);
    assert_eq!(start.semaphore, Some(DATA_ADDR + 0x40));
    assert_eq!(start.semaphore_file_offset, Some(DATA_OFF + 0x40));
    assert_eq!(start.arguments, "-4@%edi 8@%rsi");
    let args = start.args.as_ref().expect("args");
    assert_eq!(args[0].location, ArgLocation::Register(reg("rdi")));
    assert!(args[0].signed);
    // Ground truth: the bytes at the offset are the fixture's nops.
    assert_eq!(elf[start.file_offset as usize], 0x90);

    let done = &probes[1];
    assert_eq!((done.semaphore, done.semaphore_file_offset), (None, None));
    assert_eq!(done.args, Ok(vec![]));
    assert_eq!(probes[2].semaphore_file_offset, Some(DATA_OFF + 0x500));
    assert_eq!(find(&probes, "app", "late").count(), 1);
    assert_eq!(find(&probes, "other", "late").count(), 0);
}

#[test]
fn prelinked_notes_are_corrected_by_stapsdt_base() {
    // The notes were written when .stapsdt.base was at 0x400800; the file was
    // then moved by 0x1000 (prelink), .stapsdt.base with it.
    let moved = 0x1000;
    let mut fx =
        ElfFixture::new(vec![note(TEXT_ADDR + 0x10 - moved, 0x40_0800, DATA_ADDR + 0x40 - moved, "app", "p", "")]);
    fx.stapsdt_base = Some(0x40_0800 + moved);
    let probes = parse_notes(&fx.build()).expect("parse");
    assert_eq!(probes[0].address, TEXT_ADDR + 0x10);
    assert_eq!(probes[0].note_base, 0x40_0800);
    assert_eq!(probes[0].file_offset, TEXT_OFF + 0x10);
    assert_eq!(probes[0].semaphore_file_offset, Some(DATA_OFF + 0x40));
    // Without .stapsdt.base nothing is corrected.
    let uncorrected = ElfFixture::new(vec![note(TEXT_ADDR + 0x10, 0x40_0800, 0, "app", "p", "")]);
    assert_eq!(parse_notes(&uncorrected.build()).expect("parse")[0].address, TEXT_ADDR + 0x10);
}

#[test]
fn rip_relative_symbols_resolve_relative_to_the_probe() {
    let pc = TEXT_ADDR + 0x10;
    let mut fx =
        ElfFixture::new(vec![note(pc, 0, 0, "app", "p", "8@counter(%rip) -4@counter+8(%rip) 4@global 8@$global+4")]);
    fx.symbols = vec![("counter", DATA_ADDR + 0x40), ("global", DATA_ADDR + 0x80)];
    let probes = parse_notes(&fx.build()).expect("parse");
    let args = probes[0].args.as_ref().expect("args");
    let rip = Some(reg("rip"));
    let disp = |addr: u64| addr as i64 - pc as i64;
    assert_eq!(args[0].location, ArgLocation::Memory { base: rip, index: None, displacement: disp(DATA_ADDR + 0x40) });
    assert_eq!(args[1].location, ArgLocation::Memory { base: rip, index: None, displacement: disp(DATA_ADDR + 0x48) });
    assert_eq!(args[2].location, ArgLocation::Memory { base: rip, index: None, displacement: disp(DATA_ADDR + 0x80) });
    let rip = reg("rip");
    assert_eq!(args[3].location, ArgLocation::Address { base: rip, displacement: disp(DATA_ADDR + 0x84) });
    let spec = probes[0].bpf_spec().expect("spec");
    assert_eq!((spec.arg_count, spec.args[0].reg_offset), (4, 128));
    // An address is the register plus the displacement, with no memory read.
    let a = spec.args[3];
    assert_eq!((a.kind, a.reg_offset, a.displacement), (UsdtArgKind::Register as u32, 128, disp(DATA_ADDR + 0x84)));

    // A symbol the file does not define: the probe is listed, its args are an error.
    let fx = ElfFixture::new(vec![note(pc, 0, 0, "app", "p", "8@missing(%rip)")]);
    let probes = parse_notes(&fx.build()).expect("parse");
    assert!(matches!(&probes[0].args, Err(ArgSpecError::UnknownSymbol { symbol, .. }) if symbol == "missing"));
    assert!(probes[0].bpf_spec().is_err());
}

#[test]
fn too_many_arguments_for_the_map() {
    let fx = ElfFixture::new(vec![note(TEXT_ADDR, 0, 0, "app", "p", &["8@%rax"; USDT_MAX_ARGS + 1].join(" "))]);
    let probes = parse_notes(&fx.build()).expect("parse");
    assert!(matches!(probes[0].bpf_spec(), Err(ArgSpecError::TooMany { count: 7, .. })));
}

#[test]
fn other_machines_keep_their_notes_without_decoded_arguments() {
    let mut fx = ElfFixture::new(vec![note(TEXT_ADDR, 0, 0, "app", "p", "-4@x0")]);
    fx.machine = 183; // EM_AARCH64
    let probes = parse_notes(&fx.build()).expect("parse");
    assert_eq!(probes[0].args, Err(ArgSpecError::UnsupportedMachine(183)));
}

#[test]
fn broken_notes_are_errors() {
    let short = raw_note(b"stapsdt\0", 3, &[0; 20]);
    assert!(matches!(parse_notes(&ElfFixture::new(vec![short]).build()), Err(UsdtError::Malformed(_))));
    let mut desc = vec![0u8; 24];
    desc.extend_from_slice(b"prov\0name"); // no NUL after the name, no args
    let unterminated = raw_note(b"stapsdt\0", 3, &desc);
    assert!(matches!(parse_notes(&ElfFixture::new(vec![unterminated]).build()), Err(UsdtError::Malformed(_))));
    // A probe outside any executable segment (here: in the data segment).
    let misplaced = note(DATA_ADDR + 8, 0, 0, "app", "p", "");
    assert!(matches!(
        parse_notes(&ElfFixture::new(vec![misplaced]).build()),
        Err(UsdtError::ProbeNotMapped { address, .. }) if address == DATA_ADDR + 8
    ));
    let bad_sema = note(TEXT_ADDR, 0, TEXT_ADDR + 8, "app", "p", "");
    assert!(matches!(parse_notes(&ElfFixture::new(vec![bad_sema]).build()), Err(UsdtError::SemaphoreNotMapped { .. })));
    assert!(parse_notes(b"not an elf").is_err());
}

#[test]
fn a_file_without_notes_has_no_probes() {
    let exe = std::env::current_exe().expect("current exe");
    let data = std::fs::read(exe).expect("read exe");
    assert_eq!(parse_notes(&data).expect("parse"), vec![]);
}

/// Debian's python3.11, when installed: every probe's offset holds a `nop`,
/// every semaphore lies in `.probes`, and function__entry's arguments are
/// what `readelf -n` prints.
#[test]
fn debians_python_notes_agree_with_its_sections() {
    let Ok(data) = std::fs::read("/usr/bin/python3.11") else {
        crate::skip_test("/usr/bin/python3.11 not installed");
        return;
    };
    let probes = parse_notes(&data).expect("parse");
    let file = object::File::parse(&*data).expect("elf");
    let Some(probes_section) = file.section_by_name(".probes") else {
        crate::skip_test("this python3.11 has no USDT probes");
        return;
    };
    let (sema_lo, sema_len) = probes_section.file_range().expect("in file");
    assert!(probes.len() >= 2, "python3.11 has USDT probes");
    for p in &probes {
        assert_eq!(p.provider, "python");
        assert_eq!(data[p.file_offset as usize], 0x90, "{p}: nop at {:#x}", p.file_offset);
        let s = p.semaphore_file_offset.expect("python's probes have semaphores");
        assert!(s >= sema_lo && s + 2 <= sema_lo + sema_len, "{p}: semaphore {s:#x} in .probes");
        assert!(p.args.is_ok(), "{p}: {:?}", p.args);
    }
    let entry = find(&probes, "python", "function__entry").next().expect("function__entry");
    let args = entry.args.as_ref().expect("args");
    assert_eq!(args.len(), 3);
    assert!(args[..2].iter().all(|a| a.size == 8 && !a.signed));
    assert_eq!((args[2].size, args[2].signed), (4, true));
}
