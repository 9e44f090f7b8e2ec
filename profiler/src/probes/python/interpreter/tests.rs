use super::*;

#[test]
fn eval_frame_offset_is_the_getters_load_displacement() {
    // mov rax, [rdi+0x2148]; test rax, rax
    let plain = [0x48, 0x8b, 0x87, 0x48, 0x21, 0, 0, 0x48, 0x85, 0xc0];
    assert_eq!(eval_frame_offset(&plain, 0x1000), Some(0x2148));
    let with_endbr = [&ENDBR64[..], &plain[..]].concat();
    assert_eq!(eval_frame_offset(&with_endbr, 0x1000), Some(0x2148));
    // mov rax, [rsi+0x10]: not the interpreter argument.
    assert_eq!(eval_frame_offset(&[0x48, 0x8b, 0x46, 0x10], 0x1000), None);
    assert_eq!(eval_frame_offset(&[0xc3], 0x1000), None);
}

#[test]
fn debug_offsets_need_their_cookie_and_a_gil_build() {
    let mut b = vec![0u8; DEBUG_OFFSETS_LEN as usize];
    assert_eq!(from_debug_offsets(&b, (3, 13)), Err(CPythonError::DebugOffsets));
    b[..8].copy_from_slice(DEBUG_COOKIE);
    b[40..48].copy_from_slice(&0x278u64.to_le_bytes());
    let (head, layout) = from_debug_offsets(&b, (3, 14)).expect("3.14");
    assert_eq!((head, layout.code_mask, layout.co_name), (0x278, !7, 0x78));
    b[16] = 1;
    assert_eq!(from_debug_offsets(&b, (3, 14)), Err(CPythonError::Unsupported(3, 14)));
}

/// Ground truth from each build's own debug info (gdb, see the module doc):
/// `(version, interpreters.head, eval_frame, frame code, co_flags, co_name, co_filename, sizeof(PyASCIIObject))`.
/// `(release, version, interpreters.head, eval_frame, [code, co_flags, co_name, co_filename, ascii])`.
type Expected = (&'static str, (u8, u8), u64, u64, [u32; 5]);
const PYENV: [Expected; 4] = [
    ("3.10.13", (3, 10), 0x20, 0x558, [0x20, 0x24, 0x70, 0x68, 48]),
    ("3.11.7", (3, 11), 0x28, 0x590, [0x20, 0x30, 0x78, 0x70, 48]),
    ("3.12.1", (3, 12), 0x28, 0x6d0, [0, 0x30, 0x78, 0x70, 40]),
    ("3.13.0", (3, 13), 0x278, 0x2118, [0, 0x30, 0x78, 0x70, 40]),
];

#[test]
fn pyenv_builds_match_their_debug_info() {
    let mut seen = 0;
    for (release, version, head, eval_frame, [code, co_flags, co_name, co_filename, ascii]) in PYENV {
        let minor = release.split('.').nth(1).unwrap_or_default();
        let path = format!("/root/.pyenv/versions/{release}/lib/libpython3.{minor}.so.1.0");
        let Ok(bytes) = std::fs::read(&path) else {
            crate::skip_test(format!("{path} not installed"));
            continue;
        };
        seen += 1;
        let b = inspect(&bytes).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!((b.version, b.interpreters_head, b.eval_frame), (version, head, eval_frame), "{path}");
        let l = b.layout;
        assert_eq!(
            [l.code, l.co_flags, l.co_name, l.co_filename, l.ascii_data],
            [code, co_flags, co_name, co_filename, ascii]
        );
        // The probe goes on the function's first byte (pyenv builds have no endbr64) of the exported symbol.
        assert_eq!(b.entry_skip, 0, "{path}");
        assert_eq!(&bytes[b.eval_default_file_offset as usize..][..2], &[0x41, 0x57], "{path}: push r15");
        assert_eq!(b.needs_write(), version >= (3, 11));
        assert!(b.to_string().contains(&format!("CPython {}.{}", version.0, version.1)));
    }
    if seen == 0 {
        crate::skip_test("no pyenv CPython under /root/.pyenv/versions");
    }
}

#[test]
fn not_cpython_says_what_is_missing() {
    let exe = std::fs::read(std::env::current_exe().expect("exe")).expect("read");
    assert_eq!(inspect(&exe), Err(CPythonError::Missing(EVAL_FRAME_DEFAULT)));
    assert_eq!(inspect(b"#!/bin/sh"), Err(CPythonError::NotElf));
}

/// `(file, version, interpreters.head, eval_frame, code mask)`.
type DebianCase = (&'static str, (u8, u8), u64, u64, u64);

/// Debian's 3.13.5 (trixie) and 3.14.10 (sid) as `cargo xtask fixtures`
/// unpacks them: values the python_any integration tests saw work (exact step
/// counts on both). `endbr64` builds: the probes go 4 bytes in.
#[test]
fn debian_builds_describe_themselves() {
    let cases: [DebianCase; 2] = [
        ("trixie/root/usr/bin/python3.13", (3, 13), 0x278, 0x2118, u64::MAX),
        ("sid/root/usr/bin/python3.14", (3, 14), 0x328, 0x2148, !7),
    ];
    let mut seen = 0;
    for (file, version, head, eval_frame, code_mask) in cases {
        let path = format!("/var/cache/profiler/debian-python/{file}");
        let Ok(bytes) = std::fs::read(&path) else {
            crate::skip_test(format!("{path} not installed"));
            continue;
        };
        seen += 1;
        let b = inspect(&bytes).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!((b.version, b.interpreters_head, b.eval_frame), (version, head, eval_frame), "{path}");
        assert_eq!((b.entry_skip, b.layout.code_mask, b.source), (4, code_mask, "_Py_DebugOffsets"), "{path}");
        assert_eq!(&bytes[b.eval_default_file_offset as usize..][..4], &[0xf3, 0x0f, 0x1e, 0xfa], "{path}");
        let l = b.layout;
        assert_eq!([l.code, l.co_flags, l.co_name, l.co_filename, l.ascii_data], [0, 0x30, 0x78, 0x70, 40]);
    }
    if seen == 0 {
        crate::skip_test("Debian's python3.13/3.14 not unpacked (cargo xtask fixtures)");
    }
}

#[test]
fn candidates_are_the_executable_then_libpython() {
    let f = |p: &str| MappedFile { dev: (8, 1), inode: 1, path: p.into() };
    let mapped = [f("/usr/bin/python3.11"), f("/usr/lib/libpython3.11.so.1.0"), f("/usr/lib/libc.so.6")];
    assert_eq!(
        candidates(Path::new("/usr/bin/python3.11"), &mapped),
        vec![PathBuf::from("/usr/bin/python3.11"), PathBuf::from("/usr/lib/libpython3.11.so.1.0")]
    );
}

#[test]
fn candidates_name_the_program_a_loader_run_by_hand_maps() {
    let f = |p: &str| MappedFile { dev: (8, 1), inode: 1, path: p.into() };
    let ld = "/opt/trixie/lib/ld-linux-x86-64.so.2";
    let mapped = [f("/opt/trixie/usr/bin/python3.13"), f("/opt/trixie/lib/libc.so.6"), f(ld)];
    assert_eq!(
        candidates(Path::new(ld), &mapped),
        vec![PathBuf::from(ld), PathBuf::from("/opt/trixie/usr/bin/python3.13")]
    );
}

/// pyenv builds `--enable-shared`: the executable names its libpython
/// (DT_NEEDED) and where it is (RUNPATH); a file without one names none.
#[test]
fn needed_libpython_follows_runpath() {
    let exe = Path::new("/root/.pyenv/versions/3.12.1/bin/python3.12");
    if !exe.exists() {
        crate::skip_test("no pyenv 3.12.1");
        return;
    }
    assert_eq!(
        needed_libpython(exe, None),
        vec![PathBuf::from("/root/.pyenv/versions/3.12.1/lib/libpython3.12.so.1.0")]
    );
    let me = std::env::current_exe().expect("exe");
    assert!(needed_libpython(&me, Some("/nonexistent")).is_empty());
}
