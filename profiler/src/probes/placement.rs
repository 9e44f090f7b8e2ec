//! Where on a launch entry point its uprobe goes: the first instruction the kernel emulates, when nothing before it
//! changes what the probe reads.
//!
//! # Why
//!
//! A uprobe replaces an instruction with `int3`. After the handlers run, the kernel must execute the displaced
//! instruction: a few kinds it *emulates* (adjusts the saved registers and returns to user space), every other one it
//! *single-steps* out of line (copies it to the XOL page, returns with the trap flag set, takes a debug trap, fixes
//! up). The genuine NVIDIA 535 `libcuda.so.1` starts every exported entry point with
//! `cmpl $imm32, off(%rip); je …; jmp *off(%rip)`: the RIP-relative `cmpl` is single-stepped (with a scratch-register
//! rewrite), and a probe there costs about 6.3 µs per launch on our machines against 1.3 µs on the `je` at +0xa,
//! which the kernel emulates, with the same argument registers.
//!
//! # Rules
//!
//! [`choose`] decodes the function from its entry, straight-line, and returns the first instruction that is
//! *emulated on the running kernel* (see the table below), provided every instruction before it is *passable*:
//!
//! 1. **Reached on every path.** The walk never passes an instruction whose flow control is not "next": no
//!    conditional or unconditional jump, call, `ret`, `int3`, indirect jump or call, `syscall`. A branch can only be
//!    the probe point itself (it runs before it diverges). So the probe point is reached exactly when the entry is.
//!    As a check on that, no direct branch found in the bytes given may target an address after the entry up to and
//!    including the probe point (that would fire the probe twice, or without the entry); a branch back to the entry
//!    itself is harmless.
//! 2. **Nothing the probe reads has changed.** The launch programs read rdi, rsi, rdx, rcx, r8, r9, the stack
//!    slots above the return address, and memory that pointer arguments point to. A passable instruction therefore:
//!    writes no argument register (any width); writes rsp only as a `push` of a 64-bit register, whose 8 bytes
//!    are added to [`Placement::stack_adjust`]; writes no memory at all (except that push, below the entry rsp);
//!    writes no register other than general-purpose ones (flags are fine: the probe does not read them, and the
//!    kernel's emulation of a `jcc` reads the flags the program computed, as single-stepping would). rbp, rbx, rax,
//!    r10–r15 may change: nothing reads them.
//! 3. **Nothing can fault before the probe.** A passable instruction reads memory only RIP-relative (this module's
//!    own image, mapped while its code runs), rsp-relative (the stack), or fs/gs-relative without registers (TLS,
//!    e.g. a stack-protector canary). A read through any other register could fault (a null pointer argument),
//!    killing a call that an entry probe would have recorded. `lea` and the memory-operand NOPs access no memory.
//! 4. **Side-effect free.** Only these mnemonics pass: `cmp`, `test`, `bt`, `mov`, `movzx`, `movsx`, `movsxd`, `lea`,
//!    `add`, `sub`, `and`, `or`, `xor`, `inc`, `dec`, `nop` (all forms), `endbr64`, `push` (register), each still
//!    subject to rules 2–3 (so `sub rsp, N`, `mov rdi, …` and `mov [rsp], …` stop the walk). Anything else stops it.
//!
//! The walk stops at the first instruction that is emulated (the answer), or that is not passable (fall back to the
//! entry, with the reason). If the entry itself is emulated, offset 0 is already as cheap as it gets. Undecodable or
//! too few bytes also fall back to the entry.
//!
//! `endbr64` (`f3 0f 1e fa`) is *not* emulated by any kernel up to 6.18 (its opcode `0f 1e` is no branch, and it is
//! not in the kernel's NOP table), but it is passable: it changes no state (Linux enables indirect branch tracking
//! for the kernel only, never for user space).
//!
//! # What the kernel emulates (x86-64 user space)
//!
//! From `arch/x86/kernel/uprobes.c`: `arch_uprobe_analyze_insn()` tries `branch_setup_xol_ops()`, then
//! `push_setup_xol_ops()`; whatever neither takes gets `default_xol_ops` (single-step). Classes, with the first
//! kernel release that emulates them:
//!
//! | class | bytes | since | source |
//! |---|---|---|---|
//! | conditional jump | `70`–`7f` rel8, `0f 80`–`0f 8f` rel32 | 3.15 | `branch_setup_xol_ops`: `is_cond_jmp_opcode(opc1)`, with `OPCODE2 - 0x10` for the near forms |
//! | jump | `eb` rel8, `e9` rel32 | 3.15 | `case 0xeb: /* jmp 8 */ case 0xe9: /* jmp 32 */` |
//! | call | `e8` rel32 | 3.15 | `case 0xe8: /* call relative */` (emulated as push of the return address + jump) |
//! | one-byte NOP | `90` | 3.15 | `case 0x90: /* prefix* + nop; same as jmp with .offs = 0 */` |
//! | `xchg %ax,%ax` | `66 90` | 6.2 | commit cefa72129e45 "uprobes/x86: Allow to probe a NOP instruction with 0x66 prefix" (`case 0x90` jumps past the `66` check; also in 6.1.y stable). Before it the probe cannot even be registered there |
//! | table NOP | `x86_nops[1..=8]` byte for byte (below) | 6.16 | commit 610f6e14c29d "uprobes/x86: Add support to emulate NOP instructions" (tip perf/core, April 2025): `memcmp(insn->kaddr, x86_nops[insn->length], …)` |
//! | push | `50`–`57` (1 byte), `41 50`–`41 57` (2 bytes) | 4.16 | `push_setup_xol_ops`, commit e7ed9d9bd037 "uprobes/x86: Emulate push insns for uprobe on x86" (absent in 4.15, present in 4.18) |
//!
//! The 3.15 classes come from Oleg Nesterov's 2014 `branch_xol_ops` series; every kernel we support (>= 5.15) has
//! them and the push emulation, so there only the two NOP rows after the first depend on the version.
//!
//! `x86_nops` for x86-64 (`arch/x86/include/asm/nops.h`, BYTES_NOP1..8): `90`, `66 90`, `0f 1f 00`, `0f 1f 40 00`,
//! `0f 1f 44 00 00`, `66 0f 1f 44 00 00`, `0f 1f 80 00 00 00 00`, `0f 1f 84 00 00 00 00 00`. Longer compiler
//! padding (`66 0f 1f 84 …`, `66 2e 0f 1f 84 …`) is not in it.
//!
//! Forms this module treats as *not* emulated, to stay on the safe side of the kernel's checks:
//! - any branch with a `66` prefix: `branch_setup_xol_ops` rejects it with `-ENOTSUPP` (commit 250bbd12c2fe
//!   "uprobes/x86: Refuse to attach uprobe to "word-sized" branch insns"), which fails the whole probe
//!   registration; before 6.2 that included `66 90`, whose opcode byte is `90`;
//! - any instruction with a `26`/`2e`/`36`/`3e`/`f0` prefix (`is_prefix_bad()`: the probe cannot be registered);
//! - other prefixed forms (`f3 90` PAUSE, `41 90` which is really `xchg %r8,%rax`, REX-prefixed branches): the
//!   kernel's treatment has changed over time (a 2025 proposal to unify `insn_is_nop()` stops treating `f3 90` as
//!   a NOP), and compilers do not emit them at function entries. A `push` with any prefix but `41` (e.g. `48 53`) is single-stepped, so it is passable,
//!   not a probe point.
//!
//! Misjudging emulation costs only speed, never correctness: the probe fires at the same point either way. (The
//! one exception is `66 90` on a kernel that claims 6.2 without cefa72129e45: there attaching fails, loudly.) What
//! makes a moved probe correct is rules 1–4.
//!
//! # For callers
//!
//! - Stack arguments: the programs read slot `n` at `rsp + 8 * (n + 1)` assuming function-entry state. At a moved
//!   probe read `rsp + stack_adjust + 8 * (n + 1)` (pass `stack_adjust` to the program, e.g. as part of the
//!   attach cookie or a per-attachment map entry). Registers are unchanged by construction.
//! - Return probes hijack the return address at `[rsp]`; they may share a moved point only when nothing was
//!   pushed before it (`stack_adjust` 0). Otherwise keep them at the entry, and know that a second breakpoint
//!   at the entry single-steps that instruction again, giving back the saving.
//! - The decision is pure: give it the function's bytes (up to [`WINDOW`]) and its virtual address.

use std::fmt;

use iced_x86::{
    Decoder, DecoderError, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess,
    OpKind, Register,
};

/// A kernel release as (major, minor), e.g. `(6, 18)`.
pub type KernelVersion = (u32, u32);

/// How many bytes of a function's entry [`choose`] needs: enough for a few prologue instructions (at most 15
/// bytes each) and the branch-target check.
pub const WINDOW: usize = 64;

/// The integer argument registers of the System V x86-64 ABI: what the launch programs read.
const ARGUMENT_REGISTERS: [Register; 6] =
    [Register::RDI, Register::RSI, Register::RDX, Register::RCX, Register::R8, Register::R9];

/// `x86_nops[1..=8]` for x86-64 (`arch/x86/include/asm/nops.h`): the NOPs the kernel emulates since 6.16.
const KERNEL_NOPS: [&[u8]; 8] = [
    &[0x90],
    &[0x66, 0x90],
    &[0x0f, 0x1f, 0x00],
    &[0x0f, 0x1f, 0x40, 0x00],
    &[0x0f, 0x1f, 0x44, 0x00, 0x00],
    &[0x66, 0x0f, 0x1f, 0x44, 0x00, 0x00],
    &[0x0f, 0x1f, 0x80, 0x00, 0x00, 0x00, 0x00],
    &[0x0f, 0x1f, 0x84, 0x00, 0x00, 0x00, 0x00, 0x00],
];

/// An instruction class the kernel executes by emulation rather than by single-stepping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Emulated {
    /// `jcc rel8` / `jcc rel32`.
    ConditionalJump,
    /// `jmp rel8` / `jmp rel32`.
    Jump,
    /// `call rel32`.
    Call,
    /// The one-byte `nop` (`90`).
    Nop,
    /// `66 90` (`xchg %ax,%ax`), the two-byte NOP.
    PrefixedNop,
    /// A multi-byte NOP from the kernel's `x86_nops` table.
    TableNop,
    /// `push` of a 64-bit register without a prefix other than `41`.
    Push,
}

impl Emulated {
    /// The first kernel release that emulates this class.
    pub const fn since(self) -> KernelVersion {
        match self {
            Self::ConditionalJump | Self::Jump | Self::Call | Self::Nop => (3, 15),
            Self::Push => (4, 16),
            Self::PrefixedNop => (6, 2),
            Self::TableNop => (6, 16),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::ConditionalJump => "conditional jump",
            Self::Jump => "relative jump",
            Self::Call => "relative call",
            Self::Nop => "nop",
            Self::PrefixedNop => "two-byte nop",
            Self::TableNop => "multi-byte nop",
            Self::Push => "push",
        }
    }
}

/// Why the probe stays at the entry although the entry instruction is single-stepped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// No bytes were given.
    Empty,
    /// The bytes ended before an emulated instruction, at this offset.
    OutOfBytes { offset: u64 },
    /// The bytes at this offset are no valid x86-64 instruction.
    Undecodable { offset: u64 },
    /// A branch, call, return, trap or system call that is not emulated here: paths may diverge after it.
    ControlFlow { offset: u64, mnemonic: Mnemonic },
    /// An instruction outside the side-effect-free list.
    NotSideEffectFree { offset: u64, mnemonic: Mnemonic },
    /// Writes an argument register the probe reads.
    WritesArgument { offset: u64, mnemonic: Mnemonic, register: Register },
    /// Moves rsp other than by a register push.
    WritesStackPointer { offset: u64, mnemonic: Mnemonic },
    /// Writes a register that is not general-purpose (segment, vector, control, …).
    WritesOtherRegister { offset: u64, mnemonic: Mnemonic, register: Register },
    /// Writes memory.
    Stores { offset: u64, mnemonic: Mnemonic },
    /// Reads memory through a register other than rip or rsp: could fault before the probe.
    ReadsThroughPointer { offset: u64, mnemonic: Mnemonic },
    /// A branch at `from` targets `target`, after the entry and not after the would-be probe point at `offset`.
    BranchedInto { offset: u64, from: u64, target: u64 },
}

/// Why [`choose`] picked its offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlacementReason {
    /// The entry instruction is emulated already.
    EntryEmulated(Emulated),
    /// Moved past `passed` passable instructions to an emulated one.
    Moved { emulated: Emulated, passed: u32 },
    /// No usable emulated instruction: the probe stays at the entry.
    Fallback(Fallback),
}

/// Where to attach a function's entry probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Bytes from the function's start.
    pub offset: u64,
    /// Bytes pushed between the entry and the probe point: add to rsp-relative stack-argument offsets.
    pub stack_adjust: u64,
    pub reason: PlacementReason,
}

impl Placement {
    fn entry(reason: PlacementReason) -> Self {
        Self { offset: 0, stack_adjust: 0, reason }
    }

    /// Whether the kernel emulates the instruction at the probe point (the probe is cheap).
    #[cfg(test)]
    pub fn emulated(&self) -> Option<Emulated> {
        match self.reason {
            PlacementReason::EntryEmulated(e) | PlacementReason::Moved { emulated: e, .. } => Some(e),
            PlacementReason::Fallback(_) => None,
        }
    }
}

fn mnemonic_name(m: Mnemonic) -> String {
    format!("{m:?}").to_lowercase()
}

fn register_name(r: Register) -> String {
    format!("{r:?}").to_lowercase()
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Empty => write!(f, "no code bytes"),
            Self::OutOfBytes { offset } => write!(f, "code bytes end at +{offset:#x}"),
            Self::Undecodable { offset } => write!(f, "undecodable instruction at +{offset:#x}"),
            Self::ControlFlow { offset, mnemonic } => {
                write!(f, "{} at +{offset:#x} is control flow the kernel does not emulate", mnemonic_name(mnemonic))
            }
            Self::NotSideEffectFree { offset, mnemonic } => {
                write!(f, "{} at +{offset:#x} is not known to be side-effect free", mnemonic_name(mnemonic))
            }
            Self::WritesArgument { offset, mnemonic, register } => write!(
                f,
                "{} at +{offset:#x} writes argument register {}",
                mnemonic_name(mnemonic),
                register_name(register)
            ),
            Self::WritesStackPointer { offset, mnemonic } => {
                write!(f, "{} at +{offset:#x} moves rsp other than by a push", mnemonic_name(mnemonic))
            }
            Self::WritesOtherRegister { offset, mnemonic, register } => {
                write!(f, "{} at +{offset:#x} writes {}", mnemonic_name(mnemonic), register_name(register))
            }
            Self::Stores { offset, mnemonic } => write!(f, "{} at +{offset:#x} writes memory", mnemonic_name(mnemonic)),
            Self::ReadsThroughPointer { offset, mnemonic } => {
                write!(f, "{} at +{offset:#x} reads memory through a pointer and could fault", mnemonic_name(mnemonic))
            }
            Self::BranchedInto { offset, from, target } => {
                write!(f, "the branch at +{from:#x} targets +{target:#x}, at or before the probe point +{offset:#x}")
            }
        }
    }
}

impl fmt::Display for PlacementReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::EntryEmulated(e) => write!(f, "entry is a {}, which the kernel emulates", e.name()),
            Self::Moved { emulated, passed } => {
                write!(f, "moved past {passed} instruction(s) to a {}, which the kernel emulates", emulated.name())
            }
            Self::Fallback(why) => write!(f, "entry (single-stepped): {why}"),
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "+{:#x}", self.offset)?;
        if self.stack_adjust != 0 {
            write!(f, " (stack +{})", self.stack_adjust)?;
        }
        write!(f, ": {}", self.reason)
    }
}

/// `major.minor` of the running kernel (`uname(2)`).
pub fn running_kernel_version() -> Option<KernelVersion> {
    kernel_version(rustix::system::uname().release().to_str().ok()?)
}

/// `major.minor` of a kernel release string such as `6.18.44-fc-v669` (`uname -r`).
pub fn kernel_version(release: &str) -> Option<KernelVersion> {
    let mut parts = release.split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// The emulated class of the instruction whose exact bytes are `bytes`, ignoring the kernel version.
fn classify(bytes: &[u8]) -> Option<Emulated> {
    match bytes {
        [0x90] => return Some(Emulated::Nop),
        [0x66, 0x90] => return Some(Emulated::PrefixedNop),
        _ => {}
    }
    if KERNEL_NOPS.contains(&bytes) {
        return Some(Emulated::TableNop);
    }
    // Only the plain forms, or with the `f2` prefix (BND, from MPX-era toolchains) that the kernel ignores on
    // branches; see the module doc for why other prefixes count as single-stepped.
    let unprefixed = match bytes {
        [0xf2, rest @ ..] => rest,
        _ => bytes,
    };
    match unprefixed {
        [0x70..=0x7f, _] | [0x0f, 0x80..=0x8f, _, _, _, _] => Some(Emulated::ConditionalJump),
        [0xeb, _] | [0xe9, _, _, _, _] => Some(Emulated::Jump),
        [0xe8, _, _, _, _] => Some(Emulated::Call),
        _ => match bytes {
            [0x50..=0x57] | [0x41, 0x50..=0x57] => Some(Emulated::Push),
            _ => None,
        },
    }
}

fn emulated_on(bytes: &[u8], kernel: KernelVersion) -> Option<Emulated> {
    classify(bytes).filter(|e| kernel >= e.since())
}

/// Mnemonics that, operands permitting (see [`passable`]), change nothing but registers and flags.
pub(crate) const SIDE_EFFECT_FREE: [Mnemonic; 18] = [
    Mnemonic::Cmp,
    Mnemonic::Test,
    Mnemonic::Bt,
    Mnemonic::Mov,
    Mnemonic::Movzx,
    Mnemonic::Movsx,
    Mnemonic::Movsxd,
    Mnemonic::Lea,
    Mnemonic::Add,
    Mnemonic::Sub,
    Mnemonic::And,
    Mnemonic::Or,
    Mnemonic::Xor,
    Mnemonic::Inc,
    Mnemonic::Dec,
    Mnemonic::Nop,
    Mnemonic::Endbr64,
    Mnemonic::Push,
];

fn writes(access: OpAccess) -> bool {
    matches!(access, OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite)
}

fn reads(access: OpAccess) -> bool {
    matches!(access, OpAccess::Read | OpAccess::CondRead | OpAccess::ReadWrite | OpAccess::ReadCondWrite)
}

/// Whether the walk may pass `insn` (rules 1–4 of the module doc); on success, the bytes it pushes.
fn passable(insn: &Instruction, factory: &mut InstructionInfoFactory, offset: u64) -> Result<u64, Fallback> {
    let mnemonic = insn.mnemonic();
    if insn.flow_control() != FlowControl::Next {
        return Err(Fallback::ControlFlow { offset, mnemonic });
    }
    if !SIDE_EFFECT_FREE.contains(&mnemonic) {
        return Err(Fallback::NotSideEffectFree { offset, mnemonic });
    }
    if mnemonic == Mnemonic::Push {
        // Only a 64-bit register: `push [mem]` reads through a pointer, `push imm` does not occur in prologues, and
        // a 16-bit push would leave the stack slots misaligned.
        return if insn.op0_kind() == OpKind::Register && insn.op0_register().is_gpr64() {
            Ok(8)
        } else {
            Err(Fallback::NotSideEffectFree { offset, mnemonic })
        };
    }
    let info = factory.info(insn);
    for used in info.used_registers() {
        if !writes(used.access()) {
            continue;
        }
        let register = used.register().full_register();
        if ARGUMENT_REGISTERS.contains(&register) {
            return Err(Fallback::WritesArgument { offset, mnemonic, register });
        }
        if register == Register::RSP {
            return Err(Fallback::WritesStackPointer { offset, mnemonic });
        }
        if !register.is_gpr() {
            return Err(Fallback::WritesOtherRegister { offset, mnemonic, register });
        }
    }
    for memory in info.used_memory() {
        if writes(memory.access()) {
            return Err(Fallback::Stores { offset, mnemonic });
        }
        if !reads(memory.access()) {
            continue;
        }
        // iced resolves a RIP-relative operand to its absolute address (no base register), so ask the instruction.
        let fixed = insn.is_ip_rel_memory_operand()
            || memory.base() == Register::RSP
            || (memory.base() == Register::None
                && memory.index() == Register::None
                && matches!(memory.segment(), Register::FS | Register::GS));
        if !fixed {
            return Err(Fallback::ReadsThroughPointer { offset, mnemonic });
        }
    }
    Ok(0)
}

/// The first direct branch in `code` (linear sweep) whose target lies in `(entry, entry + upto]`, as
/// (offset of the branch, offset of its target).
fn branch_into(code: &[u8], address: u64, upto: u64) -> Option<(u64, u64)> {
    let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
    let mut insn = Instruction::default();
    while decoder.can_decode() {
        decoder.decode_out(&mut insn);
        if insn.is_invalid() {
            break;
        }
        if matches!(insn.op0_kind(), OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64) {
            let target = insn.near_branch_target().wrapping_sub(address);
            if target != 0 && target <= upto {
                return Some((insn.ip().wrapping_sub(address), target));
            }
        }
    }
    None
}

/// Where to put the entry probe of the function whose first bytes are `code` (ideally [`WINDOW`] of them, fewer
/// near the end of a section) and whose virtual address is `address`, on a kernel `kernel`. See the module doc.
pub fn choose(code: &[u8], address: u64, kernel: KernelVersion) -> Placement {
    if code.is_empty() {
        return Placement::entry(PlacementReason::Fallback(Fallback::Empty));
    }
    let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
    let mut factory = InstructionInfoFactory::new();
    let mut insn = Instruction::default();
    let mut stack_adjust = 0;
    let mut passed = 0;
    loop {
        let start = decoder.position();
        let offset = start as u64;
        if !decoder.can_decode() {
            return Placement::entry(PlacementReason::Fallback(Fallback::OutOfBytes { offset }));
        }
        decoder.decode_out(&mut insn);
        if insn.is_invalid() {
            let why = match decoder.last_error() {
                DecoderError::NoMoreBytes => Fallback::OutOfBytes { offset },
                _ => Fallback::Undecodable { offset },
            };
            return Placement::entry(PlacementReason::Fallback(why));
        }
        let bytes = code.get(start..decoder.position()).unwrap_or_default();
        if let Some(emulated) = emulated_on(bytes, kernel) {
            if offset == 0 {
                return Placement::entry(PlacementReason::EntryEmulated(emulated));
            }
            if let Some((from, target)) = branch_into(code, address, offset) {
                return Placement::entry(PlacementReason::Fallback(Fallback::BranchedInto { offset, from, target }));
            }
            return Placement { offset, stack_adjust, reason: PlacementReason::Moved { emulated, passed } };
        }
        match passable(&insn, &mut factory, offset) {
            Ok(pushed) => stack_adjust += pushed,
            Err(why) => return Placement::entry(PlacementReason::Fallback(why)),
        }
        passed += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Our target kernel, and one without table-NOP emulation.
    const K618: KernelVersion = (6, 18);
    const K515: KernelVersion = (5, 15);
    const ADDR: u64 = 0x32f860;

    /// `cmpl $0, off(%rip)` (imm8 form) and `cmpl $0x321cba00, off(%rip)` (imm32, as in the genuine library).
    const CMP_RIP_IMM8: [u8; 7] = [0x83, 0x3d, 0x3e, 0x93, 0x8d, 0x01, 0x00];
    const CMP_RIP_IMM32: [u8; 10] = [0x81, 0x3d, 0x3e, 0x93, 0x8d, 0x01, 0x00, 0xba, 0x1c, 0x32];
    const JE_SHORT: [u8; 2] = [0x74, 0x0c];
    const JMP_RIP: [u8; 6] = [0xff, 0x25, 0xc6, 0x18, 0x7e, 0x01];
    const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];

    fn code(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    fn fallback(p: &Placement) -> &Fallback {
        match &p.reason {
            PlacementReason::Fallback(f) => f,
            other => panic!("expected a fallback, got {other}"),
        }
    }

    #[test]
    fn genuine_shape_moves_to_the_je() {
        let c = code(&[&CMP_RIP_IMM8, &JE_SHORT, &JMP_RIP]);
        let p = choose(&c, ADDR, K618);
        assert_eq!(p.offset, 7);
        assert_eq!(p.stack_adjust, 0);
        assert_eq!(p.reason, PlacementReason::Moved { emulated: Emulated::ConditionalJump, passed: 1 });
        assert_eq!(p.stack_adjust, 0);

        let c = code(&[&CMP_RIP_IMM32, &JE_SHORT, &JMP_RIP]);
        assert_eq!(choose(&c, ADDR, K618).offset, 0xa);
        // The conditional-jump emulation is older than any kernel we run on.
        assert_eq!(choose(&c, ADDR, K515).offset, 0xa);
        // A kernel that predates branch emulation: nothing to gain.
        let old = choose(&c, ADDR, (3, 14));
        assert_eq!(old.offset, 0);
        assert!(matches!(fallback(&old), Fallback::ControlFlow { offset: 0xa, mnemonic: Mnemonic::Je }));
    }

    #[test]
    fn near_jcc_is_a_probe_point_too() {
        let c = code(&[&CMP_RIP_IMM8, &[0x0f, 0x85, 0x10, 0x00, 0x00, 0x00], &JMP_RIP]);
        let p = choose(&c, ADDR, K618);
        assert_eq!((p.offset, p.emulated()), (7, Some(Emulated::ConditionalJump)));
    }

    #[test]
    fn frame_pointer_prologue_push_is_emulated_at_entry() {
        // push rbp; mov rbp, rsp; cmp …; je
        let c = code(&[&[0x55, 0x48, 0x89, 0xe5], &CMP_RIP_IMM8, &JE_SHORT]);
        let p = choose(&c, ADDR, K618);
        assert_eq!(p, Placement { offset: 0, stack_adjust: 0, reason: PlacementReason::EntryEmulated(Emulated::Push) });

        // Before push emulation (4.16) the push is passed, and `mov rbp, rsp` too: rbp is no argument register.
        let p = choose(&c, ADDR, (4, 15));
        assert_eq!((p.offset, p.stack_adjust), (1 + 3 + 7, 8));
        assert_eq!(p.reason, PlacementReason::Moved { emulated: Emulated::ConditionalJump, passed: 3 });
        assert_ne!(p.stack_adjust, 0);
    }

    #[test]
    fn pushes_the_kernel_single_steps_count_in_stack_adjust() {
        // push rbx with a REX.W prefix (48 53) is a plain push the kernel does not emulate; so is push r12 before
        // 4.16. Both are passed and shift the stack arguments.
        let c = code(&[&[0x48, 0x53], &CMP_RIP_IMM8, &JE_SHORT]);
        let p = choose(&c, ADDR, K618);
        assert_eq!((p.offset, p.stack_adjust), (9, 8));

        let c = code(&[&[0x53], &[0x41, 0x54], &CMP_RIP_IMM8, &JE_SHORT]);
        let p = choose(&c, ADDR, (4, 15));
        assert_eq!((p.offset, p.stack_adjust), (10, 16));
        // On a current kernel the `push rbx` at the entry is emulated.
        assert_eq!(choose(&c, ADDR, K618).reason, PlacementReason::EntryEmulated(Emulated::Push));
    }

    #[test]
    fn an_emulated_push_after_the_entry_is_the_probe_point() {
        // endbr64; push r12; cmp; je: stop at the push, before it has moved rsp.
        let c = code(&[&ENDBR64, &[0x41, 0x54], &CMP_RIP_IMM8, &JE_SHORT]);
        let p = choose(&c, ADDR, K618);
        assert_eq!((p.offset, p.stack_adjust, p.emulated()), (4, 0, Some(Emulated::Push)));
    }

    #[test]
    fn endbr64_is_passed_not_emulated() {
        assert_eq!(classify(&ENDBR64), None);
        let c = code(&[&ENDBR64, &[0xe9, 0x00, 0x01, 0x00, 0x00]]);
        let p = choose(&c, ADDR, K618);
        assert_eq!(p.offset, 4);
        assert_eq!(p.reason, PlacementReason::Moved { emulated: Emulated::Jump, passed: 1 });
    }

    #[test]
    fn writing_an_argument_register_falls_back() {
        // cmp; mov rdi, rax; jne
        let c = code(&[&CMP_RIP_IMM8, &[0x48, 0x89, 0xc7], &[0x75, 0x02]]);
        let p = choose(&c, ADDR, K618);
        assert_eq!(p.offset, 0);
        assert_eq!(
            *fallback(&p),
            Fallback::WritesArgument { offset: 7, mnemonic: Mnemonic::Mov, register: Register::RDI }
        );
        // A 32-bit write zero-extends into the full register: just as bad.
        let c = code(&[&[0x31, 0xc9], &JE_SHORT]); // xor ecx, ecx
        assert!(matches!(fallback(&choose(&c, ADDR, K618)), Fallback::WritesArgument { register: Register::RCX, .. }));
        // Other registers are fine.
        let c = code(&[&[0x31, 0xc0], &JE_SHORT]); // xor eax, eax
        assert_eq!(choose(&c, ADDR, K618).offset, 2);
    }

    #[test]
    fn moving_rsp_other_than_by_push_falls_back() {
        // sub rsp, 0x18; je
        let c = code(&[&[0x48, 0x83, 0xec, 0x18], &JE_SHORT]);
        let p = choose(&c, ADDR, K618);
        assert_eq!(*fallback(&p), Fallback::WritesStackPointer { offset: 0, mnemonic: Mnemonic::Sub });
    }

    #[test]
    fn stores_fall_back() {
        // mov [rsp+8], rax; je
        let c = code(&[&[0x48, 0x89, 0x44, 0x24, 0x08], &JE_SHORT]);
        assert!(matches!(fallback(&choose(&c, ADDR, K618)), Fallback::Stores { offset: 0, .. }));
        // cmp then mov [rip+x], eax
        let c = code(&[&CMP_RIP_IMM8, &[0x89, 0x05, 0, 0, 0, 0], &JE_SHORT]);
        assert!(matches!(fallback(&choose(&c, ADDR, K618)), Fallback::Stores { offset: 7, .. }));
    }

    #[test]
    fn reads_through_pointers_fall_back_but_stack_and_tls_reads_pass() {
        // mov rax, [rdi]; je: a null first argument would fault before the probe.
        let c = code(&[&[0x48, 0x8b, 0x07], &JE_SHORT]);
        assert!(matches!(fallback(&choose(&c, ADDR, K618)), Fallback::ReadsThroughPointer { offset: 0, .. }));
        // mov rax, [rsp+8]; mov rax, fs:0x28; je
        let c = code(&[&[0x48, 0x8b, 0x44, 0x24, 0x08], &[0x64, 0x48, 0x8b, 0x04, 0x25, 0x28, 0, 0, 0], &JE_SHORT]);
        assert_eq!(choose(&c, ADDR, K618).offset, 14);
        // lea rax, [rdi+8] accesses no memory.
        let c = code(&[&[0x48, 0x8d, 0x47, 0x08], &JE_SHORT]);
        assert_eq!(choose(&c, ADDR, K618).offset, 4);
    }

    #[test]
    fn call_or_jump_at_entry_stays_at_entry() {
        let call = [0xe8, 0x10, 0x00, 0x00, 0x00];
        assert_eq!(choose(&call, ADDR, K618).reason, PlacementReason::EntryEmulated(Emulated::Call));
        let jmp = [0xe9, 0x10, 0x00, 0x00, 0x00];
        assert_eq!(choose(&jmp, ADDR, K618).reason, PlacementReason::EntryEmulated(Emulated::Jump));
        let jmp8 = [0xeb, 0x10];
        assert_eq!(choose(&jmp8, ADDR, K618).reason, PlacementReason::EntryEmulated(Emulated::Jump));
    }

    #[test]
    fn the_walk_never_passes_a_branch_or_trap() {
        // A relative call after a cmp is itself the probe point (it has not pushed yet)…
        let c = code(&[&CMP_RIP_IMM8, &[0xe8, 0, 0, 0, 0], &JE_SHORT]);
        let p = choose(&c, ADDR, K618);
        assert_eq!((p.offset, p.emulated()), (7, Some(Emulated::Call)));
        // …and indirect jumps, returns and traps stop the walk.
        for stop in [&JMP_RIP[..], &[0xc3], &[0xcc], &[0xff, 0xd0], &[0x0f, 0x05]] {
            let c = code(&[&CMP_RIP_IMM8, stop, &JE_SHORT]);
            let p = choose(&c, ADDR, K618);
            assert_eq!(p.offset, 0, "{stop:02x?}");
            assert!(matches!(fallback(&p), Fallback::ControlFlow { offset: 7, .. }), "{stop:02x?}: {p}");
        }
        // An instruction outside the list (cpuid) stops it too.
        let c = code(&[&[0x0f, 0xa2], &JE_SHORT]);
        assert!(matches!(fallback(&choose(&c, ADDR, K618)), Fallback::NotSideEffectFree { .. }));
    }

    #[test]
    fn a_branch_back_to_the_probe_point_falls_back() {
        // 0: cmp; 7: je +2; 9: jmp 7 (back onto the je: the probe would fire twice)
        let c = code(&[&CMP_RIP_IMM8, &[0x74, 0x02], &[0xeb, 0xfc]]);
        let p = choose(&c, ADDR, K618);
        assert_eq!(*fallback(&p), Fallback::BranchedInto { offset: 7, from: 9, target: 7 });
        // A loop back to the entry is fine: an entry probe fires there too.
        let c = code(&[&CMP_RIP_IMM8, &[0x74, 0x02], &[0xeb, 0xf5]]);
        assert_eq!(choose(&c, ADDR, K618).offset, 7);
    }

    #[test]
    fn nops_emulated_by_table_only_since_6_16() {
        let nop5 = [0x0f, 0x1f, 0x44, 0x00, 0x00];
        let c = code(&[&nop5, &CMP_RIP_IMM32, &JE_SHORT]);
        assert_eq!(choose(&c, ADDR, K618).reason, PlacementReason::EntryEmulated(Emulated::TableNop));
        assert_eq!(choose(&c, ADDR, (6, 16)).offset, 0);
        let p = choose(&c, ADDR, (6, 15));
        assert_eq!((p.offset, p.emulated()), (15, Some(Emulated::ConditionalJump)));

        // xchg ax, ax: before 6.2 a probe on it cannot even be registered; it must be passed.
        let c = code(&[&[0x66, 0x90], &CMP_RIP_IMM8, &JE_SHORT]);
        assert_eq!(choose(&c, ADDR, (6, 2)).reason, PlacementReason::EntryEmulated(Emulated::PrefixedNop));
        assert_eq!(choose(&c, ADDR, (6, 1)).offset, 9);
        assert_eq!(choose(&c, ADDR, K515).offset, 9);

        // The one-byte nop has always been emulated.
        assert_eq!(choose(&[0x90, 0x74, 0x00], ADDR, K515).reason, PlacementReason::EntryEmulated(Emulated::Nop));
        // Longer padding is not in the table: passed.
        let nop9 = [0x66, 0x0f, 0x1f, 0x84, 0x00, 0x00, 0x00, 0x00, 0x00];
        let c = code(&[&nop9, &JE_SHORT]);
        assert_eq!(choose(&c, ADDR, K618).offset, 9);
    }

    #[test]
    fn prefixed_forms_the_kernel_rejects_are_never_chosen() {
        for bytes in [&[0x66, 0x74, 0x00][..], &[0x2e, 0x74, 0x00], &[0x3e, 0x74, 0x00], &[0xf3, 0x90], &[0x48, 0x53]] {
            assert_eq!(classify(bytes), None, "{bytes:02x?}");
        }
        assert_eq!(classify(&[0xf2, 0xe8, 0, 0, 0, 0]), Some(Emulated::Call));
        assert_eq!(classify(&[0x41, 0x57]), Some(Emulated::Push));
        assert_eq!(classify(&[0x0f, 0x8f, 0, 0, 0, 0]), Some(Emulated::ConditionalJump));
    }

    #[test]
    fn empty_undecodable_and_truncated_bytes_fall_back() {
        assert_eq!(*fallback(&choose(&[], ADDR, K618)), Fallback::Empty);
        // 06 (push es) is invalid in 64-bit mode.
        assert_eq!(*fallback(&choose(&[0x06, 0x74, 0x00], ADDR, K618)), Fallback::Undecodable { offset: 0 });
        // A cmp cut short, and a walk that runs off the end.
        assert_eq!(*fallback(&choose(&CMP_RIP_IMM32[..6], ADDR, K618)), Fallback::OutOfBytes { offset: 0 });
        assert_eq!(*fallback(&choose(&CMP_RIP_IMM8, ADDR, K618)), Fallback::OutOfBytes { offset: 7 });
    }

    #[test]
    fn parses_kernel_releases() {
        assert_eq!(kernel_version("6.18.44-fc-v669"), Some((6, 18)));
        assert_eq!(kernel_version("5.15.0-91-generic"), Some((5, 15)));
        assert_eq!(kernel_version("6.8-rc1"), Some((6, 8)));
        assert_eq!(kernel_version("garbage"), None);
        assert!((6, 9) < (6, 16), "versions compare numerically, not as strings");
    }

    #[test]
    fn reads_the_running_kernel_as_procfs_has_it() {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("procfs is mounted");
        assert!(running_kernel_version().is_some());
        assert_eq!(running_kernel_version(), kernel_version(release.trim()));
    }

    #[test]
    fn reasons_read_as_sentences() {
        let c = code(&[&CMP_RIP_IMM32, &JE_SHORT, &JMP_RIP]);
        assert_eq!(
            choose(&c, ADDR, K618).to_string(),
            "+0xa: moved past 1 instruction(s) to a conditional jump, which the kernel emulates"
        );
        let c = code(&[&[0x48, 0x83, 0xec, 0x18], &JE_SHORT]);
        assert_eq!(
            choose(&c, ADDR, K618).to_string(),
            "+0x0: entry (single-stepped): sub at +0x0 moves rsp other than by a push"
        );
    }

    /// The genuine NVIDIA 535 driver library, fetched by `cargo xtask` into the workspace's `target/`.
    fn genuine_libcuda() -> Option<Vec<u8>> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fixtures/nvidia/lib/libcuda.so.1");
        match std::fs::read(&path) {
            Ok(data) => Some(data),
            Err(e) => {
                crate::skip_test(format!("{} not readable ({e})", path.display()));
                None
            }
        }
    }

    const DRIVER_LAUNCHES: [&str; 8] = [
        "cuLaunchKernel",
        "cuLaunchKernel_ptsz",
        "cuLaunchKernelEx",
        "cuLaunchKernelEx_ptsz",
        "cuLaunchCooperativeKernel",
        "cuLaunchCooperativeKernel_ptsz",
        "cuGraphLaunch",
        "cuGraphLaunch_ptsz",
    ];

    #[test]
    fn genuine_libcuda_entry_points_move_to_their_je() {
        let Some(data) = genuine_libcuda() else { return };
        let symbols = crate::probes::elf::function_symbols(&data).expect("parse libcuda");
        for name in DRIVER_LAUNCHES {
            let sym = symbols.iter().find(|s| s.name == name).expect("libcuda exports every launch entry point");
            let start = usize::try_from(sym.file_offset).expect("offset fits");
            let end = data.len().min(start + WINDOW);
            let bytes = &data[start..end];
            let p = choose(bytes, sym.address, K618);
            println!("{name:32} {:#x} [{}]: {p}", sym.address, hex(&bytes[..16]));
            // Ground truth from `objdump -d`: cmpl $0x321cba00, rip (10 bytes); je (+0xa); jmp *rip (+0xc).
            assert_eq!(&bytes[..2], [0x81, 0x3d], "{name}: cmpl $imm32, rip-relative");
            assert_eq!(bytes[0xa], 0x74, "{name}: je rel8 at +0xa");
            assert_eq!(&bytes[0xc..0xe], [0xff, 0x25], "{name}: jmp *rip-relative at +0xc");
            assert_eq!(p.offset, 0xa, "{name}: {p}");
            assert_eq!(p.stack_adjust, 0, "{name}");
            assert_eq!(p.emulated(), Some(Emulated::ConditionalJump), "{name}");
        }
    }

    /// `tests/fixtures/shaped_cuda.S` built as `target/fixtures/shaped/libcuda.so.1`: each entry shape with the
    /// placement it must get (offsets from `objdump -d` of the built library), on 6.18 and on 5.15.
    #[test]
    fn shaped_fixture_entry_points_get_their_designed_placements() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fixtures/shaped/libcuda.so.1");
        let Ok(data) = std::fs::read(&path) else {
            crate::skip_test(format!("{} not built", path.display()));
            return;
        };
        let symbols = crate::probes::elf::function_symbols(&data).expect("parse fixture");
        use Emulated::*;
        // (name, 6.18: offset, stack_adjust, class; 5.15: offset)
        let expected = [
            ("cuInit", 0xa, 0, ConditionalJump, 0xa),
            ("cuLaunchKernel", 0xa, 0, ConditionalJump, 0xa),
            ("cuLaunchKernel_ptsz", 9, 8, ConditionalJump, 9),
            ("cuLaunchKernelEx", 0, 0, Push, 0),
            ("cuLaunchKernelEx_ptsz", 4, 0, Push, 4),
            ("cuLaunchCooperativeKernel", 0xe, 0, ConditionalJump, 0xe),
            ("cuLaunchCooperativeKernel_ptsz", 0xb, 16, ConditionalJump, 0xb),
            ("cuGraphLaunch", 0, 0, TableNop, 0xf),
            ("cuGraphLaunch_ptsz", 0, 0, PrefixedNop, 9),
        ];
        for (name, offset, stack_adjust, emulated, offset_515) in expected {
            let sym = symbols.iter().find(|s| s.name == name).expect("fixture exports it");
            let start = usize::try_from(sym.file_offset).expect("offset fits");
            let bytes = &data[start..data.len().min(start + WINDOW)];
            let p = choose(bytes, sym.address, K618);
            println!("{name:32} {p}");
            assert_eq!((p.offset, p.stack_adjust, p.emulated()), (offset, stack_adjust, Some(emulated)), "{name}: {p}");
            let old = choose(bytes, sym.address, K515);
            assert_eq!(old.offset, offset_515, "{name} on 5.15: {old}");
        }
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
    }
}
