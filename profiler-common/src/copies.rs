//! Host↔device copies and memsets: the driver's and the runtime's entry
//! points that are probed, how each one's size and direction are read from
//! its arguments (packed into the attach cookie, so one pair of programs
//! serves every form), and the record a call leaves.
//!
//! A runtime copy reaches the driver's exported entry point (as launches do):
//! the kernel side counts a call once, as the outermost probed call on its
//! thread (see the eBPF side's `copies` module).

use crate::RecordHeader;
#[cfg(feature = "user")]
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Where a byte count (or a height) is: an integer argument register
/// (rdi, rsi, rdx, rcx, r8, r9 = 0..=5), the first stack argument (6), or nowhere.
pub const ARG_STACK0: u8 = 6;
/// No such argument.
pub const ARG_NONE: u8 = 15;

/// How a call's size and direction are found in its arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyForm {
    /// The argument holding the element count (bytes, for copies).
    pub count: u8,
    /// log2 of the element size (memsets of 16- and 32-bit values).
    pub elem_shift: u8,
    /// The argument holding the height of a 2-D call (its count is the width), or [`ARG_NONE`].
    pub height: u8,
    /// The argument holding a runtime `cudaMemcpyKind`, or [`ARG_NONE`].
    pub kind: u8,
    /// The direction when no argument says it.
    pub fixed: CopyDirection,
    /// A descriptor struct the first argument points to, which holds size and direction.
    pub layout: CopyLayout,
}

/// Descriptor structs of the 2-D and 3-D copies (first argument).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyLayout {
    None = 0,
    /// `CUDA_MEMCPY2D`: memory types at 16 (src) and 72 (dst), `WidthInBytes` at 112, `Height` at 120.
    Driver2D = 1,
    /// `CUDA_MEMCPY3D`: memory types at 32 and 120, `WidthInBytes`, `Height`, `Depth` at 176, 184, 192.
    Driver3D = 2,
    /// `cudaMemcpy3DParms`: `extent` (width, height, depth) at 128, `kind` at 152.
    Runtime3D = 3,
}

/// Offsets of the descriptor fields the kernel side reads (cuda.h / driver_types.h, x86-64).
pub mod layout_offsets {
    pub const DRIVER_2D_SRC_TYPE: u64 = 16;
    pub const DRIVER_2D_DST_TYPE: u64 = 72;
    pub const DRIVER_2D_WIDTH: u64 = 112;
    pub const DRIVER_3D_SRC_TYPE: u64 = 32;
    pub const DRIVER_3D_DST_TYPE: u64 = 120;
    pub const DRIVER_3D_WIDTH: u64 = 176;
    pub const RUNTIME_3D_EXTENT: u64 = 128;
    pub const RUNTIME_3D_KIND: u64 = 152;
}

/// Which way a copy went. Stored as text in `copies.direction`.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDirection {
    HostToDevice = 0,
    DeviceToHost = 1,
    DeviceToDevice = 2,
    HostToHost = 3,
    /// A memset: the device written, nothing read.
    Memset = 4,
    /// Unified addressing (`cuMemcpy`, `cudaMemcpyDefault`, `CU_MEMORYTYPE_UNIFIED`):
    /// only the pointers' owners know, which the probe does not ask.
    Unknown = 5,
}

impl CopyDirection {
    pub fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::HostToDevice,
            1 => Self::DeviceToHost,
            2 => Self::DeviceToDevice,
            3 => Self::HostToHost,
            4 => Self::Memset,
            _ => Self::Unknown,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::HostToDevice => "h2d",
            Self::DeviceToHost => "d2h",
            Self::DeviceToDevice => "d2d",
            Self::HostToHost => "h2h",
            Self::Memset => "memset",
            Self::Unknown => "unknown",
        }
    }

    /// A runtime `cudaMemcpyKind` (0 host→host … 3 device→device; 4, `cudaMemcpyDefault`, and
    /// anything else: unknown).
    pub fn of_runtime_kind(kind: u32) -> Self {
        match kind {
            0 => Self::HostToHost,
            1 => Self::HostToDevice,
            2 => Self::DeviceToHost,
            3 => Self::DeviceToDevice,
            _ => Self::Unknown,
        }
    }

    /// A driver descriptor's `CUmemorytype`s (1 host, 2 device, 3 array, 4 unified).
    pub fn of_memory_types(src: u32, dst: u32) -> Self {
        let side = |t: u32| match t {
            1 => Some(false),
            2 | 3 => Some(true),
            _ => None,
        };
        match (side(src), side(dst)) {
            (Some(false), Some(true)) => Self::HostToDevice,
            (Some(true), Some(false)) => Self::DeviceToHost,
            (Some(true), Some(true)) => Self::DeviceToDevice,
            (Some(false), Some(false)) => Self::HostToHost,
            _ => Self::Unknown,
        }
    }
}

/// One probed entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyEntry {
    pub symbol: &'static str,
    /// In `libcudart` (else `libcuda`).
    pub runtime: bool,
    pub form: CopyForm,
}

const fn form(count: u8, elem_shift: u8, height: u8, kind: u8, fixed: CopyDirection, layout: CopyLayout) -> CopyForm {
    CopyForm { count, elem_shift, height, kind, fixed, layout }
}
const fn linear(count: u8, fixed: CopyDirection) -> CopyForm {
    form(count, 0, ARG_NONE, ARG_NONE, fixed, CopyLayout::None)
}
const fn described(layout: CopyLayout) -> CopyForm {
    form(ARG_NONE, 0, ARG_NONE, ARG_NONE, CopyDirection::Unknown, layout)
}
const fn drv(symbol: &'static str, form: CopyForm) -> CopyEntry {
    CopyEntry { symbol, runtime: false, form }
}
const fn rt(symbol: &'static str, form: CopyForm) -> CopyEntry {
    CopyEntry { symbol, runtime: true, form }
}

use CopyDirection::{DeviceToDevice as D2D, DeviceToHost as D2H, HostToDevice as H2D, Memset, Unknown};

/// Every probed copy and memset entry point; the index is the id the kernel
/// reports ([`CopyRecord::entry`]). Per-thread default-stream forms (`_ptds`,
/// `_ptsz`) share their base form's arguments.
pub const COPY_ENTRIES: &[CopyEntry] = &[
    // cuMemcpy*(dst, src, bytes[, stream]); cuMemcpyPeer*(dst, dstCtx, src, srcCtx, bytes[, stream]).
    drv("cuMemcpy", linear(2, Unknown)),
    drv("cuMemcpy_ptds", linear(2, Unknown)),
    drv("cuMemcpyAsync", linear(2, Unknown)),
    drv("cuMemcpyAsync_ptsz", linear(2, Unknown)),
    drv("cuMemcpyHtoD_v2", linear(2, H2D)),
    drv("cuMemcpyHtoD_v2_ptds", linear(2, H2D)),
    drv("cuMemcpyHtoDAsync_v2", linear(2, H2D)),
    drv("cuMemcpyHtoDAsync_v2_ptsz", linear(2, H2D)),
    drv("cuMemcpyDtoH_v2", linear(2, D2H)),
    drv("cuMemcpyDtoH_v2_ptds", linear(2, D2H)),
    drv("cuMemcpyDtoHAsync_v2", linear(2, D2H)),
    drv("cuMemcpyDtoHAsync_v2_ptsz", linear(2, D2H)),
    drv("cuMemcpyDtoD_v2", linear(2, D2D)),
    drv("cuMemcpyDtoD_v2_ptds", linear(2, D2D)),
    drv("cuMemcpyDtoDAsync_v2", linear(2, D2D)),
    drv("cuMemcpyDtoDAsync_v2_ptsz", linear(2, D2D)),
    drv("cuMemcpyPeer", linear(4, D2D)),
    drv("cuMemcpyPeer_ptds", linear(4, D2D)),
    drv("cuMemcpyPeerAsync", linear(4, D2D)),
    drv("cuMemcpyPeerAsync_ptsz", linear(4, D2D)),
    // CUDA arrays: cu{Memcpy}HtoA/DtoA(dstArray, dstOffset, src, bytes), AtoH/AtoD(dst, srcArray,
    // srcOffset, bytes), AtoA(dstArray, dstOffset, srcArray, srcOffset, bytes); an array is device memory.
    drv("cuMemcpyHtoA_v2", linear(3, H2D)),
    drv("cuMemcpyHtoA_v2_ptds", linear(3, H2D)),
    drv("cuMemcpyHtoAAsync_v2", linear(3, H2D)),
    drv("cuMemcpyHtoAAsync_v2_ptsz", linear(3, H2D)),
    drv("cuMemcpyAtoH_v2", linear(3, D2H)),
    drv("cuMemcpyAtoH_v2_ptds", linear(3, D2H)),
    drv("cuMemcpyAtoHAsync_v2", linear(3, D2H)),
    drv("cuMemcpyAtoHAsync_v2_ptsz", linear(3, D2H)),
    drv("cuMemcpyDtoA_v2", linear(3, D2D)),
    drv("cuMemcpyDtoA_v2_ptds", linear(3, D2D)),
    drv("cuMemcpyAtoD_v2", linear(3, D2D)),
    drv("cuMemcpyAtoD_v2_ptds", linear(3, D2D)),
    drv("cuMemcpyAtoA_v2", linear(4, D2D)),
    drv("cuMemcpyAtoA_v2_ptds", linear(4, D2D)),
    drv("cuMemcpy2D_v2", described(CopyLayout::Driver2D)),
    drv("cuMemcpy2D_v2_ptds", described(CopyLayout::Driver2D)),
    drv("cuMemcpy2DUnaligned_v2", described(CopyLayout::Driver2D)),
    drv("cuMemcpy2DUnaligned_v2_ptds", described(CopyLayout::Driver2D)),
    drv("cuMemcpy2DAsync_v2", described(CopyLayout::Driver2D)),
    drv("cuMemcpy2DAsync_v2_ptsz", described(CopyLayout::Driver2D)),
    drv("cuMemcpy3D_v2", described(CopyLayout::Driver3D)),
    drv("cuMemcpy3D_v2_ptds", described(CopyLayout::Driver3D)),
    drv("cuMemcpy3DAsync_v2", described(CopyLayout::Driver3D)),
    drv("cuMemcpy3DAsync_v2_ptsz", described(CopyLayout::Driver3D)),
    // cuMemsetD{8,16,32}(dst, value, N[, stream]); cuMemsetD2D{8,16,32}(dst, pitch, value, width, height[, stream]).
    drv("cuMemsetD8_v2", linear(2, Memset)),
    drv("cuMemsetD8_v2_ptds", linear(2, Memset)),
    drv("cuMemsetD8Async", linear(2, Memset)),
    drv("cuMemsetD8Async_ptsz", linear(2, Memset)),
    drv("cuMemsetD16_v2", form(2, 1, ARG_NONE, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD16_v2_ptds", form(2, 1, ARG_NONE, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD16Async", form(2, 1, ARG_NONE, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD16Async_ptsz", form(2, 1, ARG_NONE, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD32_v2", form(2, 2, ARG_NONE, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD32_v2_ptds", form(2, 2, ARG_NONE, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD32Async", form(2, 2, ARG_NONE, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD32Async_ptsz", form(2, 2, ARG_NONE, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD2D8_v2", form(3, 0, 4, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD2D8_v2_ptds", form(3, 0, 4, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD2D8Async", form(3, 0, 4, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD2D8Async_ptsz", form(3, 0, 4, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD2D16_v2", form(3, 1, 4, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD2D16_v2_ptds", form(3, 1, 4, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD2D16Async", form(3, 1, 4, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD2D16Async_ptsz", form(3, 1, 4, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD2D32_v2", form(3, 2, 4, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD2D32_v2_ptds", form(3, 2, 4, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD2D32Async", form(3, 2, 4, ARG_NONE, Memset, CopyLayout::None)),
    drv("cuMemsetD2D32Async_ptsz", form(3, 2, 4, ARG_NONE, Memset, CopyLayout::None)),
    // cudaMemcpy*(dst, src, count, kind[, stream]).
    rt("cudaMemcpy", form(2, 0, ARG_NONE, 3, Unknown, CopyLayout::None)),
    rt("cudaMemcpy_ptds", form(2, 0, ARG_NONE, 3, Unknown, CopyLayout::None)),
    rt("cudaMemcpyAsync", form(2, 0, ARG_NONE, 3, Unknown, CopyLayout::None)),
    rt("cudaMemcpyAsync_ptsz", form(2, 0, ARG_NONE, 3, Unknown, CopyLayout::None)),
    // cudaMemcpy2D*(dst, dpitch, src, spitch, width, height, kind[, stream]): kind is on the stack.
    rt("cudaMemcpy2D", form(4, 0, 5, ARG_STACK0, Unknown, CopyLayout::None)),
    rt("cudaMemcpy2D_ptds", form(4, 0, 5, ARG_STACK0, Unknown, CopyLayout::None)),
    rt("cudaMemcpy2DAsync", form(4, 0, 5, ARG_STACK0, Unknown, CopyLayout::None)),
    rt("cudaMemcpy2DAsync_ptsz", form(4, 0, 5, ARG_STACK0, Unknown, CopyLayout::None)),
    rt("cudaMemcpy3D", described(CopyLayout::Runtime3D)),
    rt("cudaMemcpy3D_ptds", described(CopyLayout::Runtime3D)),
    rt("cudaMemcpy3DAsync", described(CopyLayout::Runtime3D)),
    rt("cudaMemcpy3DAsync_ptsz", described(CopyLayout::Runtime3D)),
    // cudaMemcpy{To,From}Symbol*(symbol|dst, src|symbol, count, offset, kind[, stream]).
    rt("cudaMemcpyToSymbol", form(2, 0, ARG_NONE, 4, Unknown, CopyLayout::None)),
    rt("cudaMemcpyToSymbol_ptds", form(2, 0, ARG_NONE, 4, Unknown, CopyLayout::None)),
    rt("cudaMemcpyToSymbolAsync", form(2, 0, ARG_NONE, 4, Unknown, CopyLayout::None)),
    rt("cudaMemcpyToSymbolAsync_ptsz", form(2, 0, ARG_NONE, 4, Unknown, CopyLayout::None)),
    rt("cudaMemcpyFromSymbol", form(2, 0, ARG_NONE, 4, Unknown, CopyLayout::None)),
    rt("cudaMemcpyFromSymbol_ptds", form(2, 0, ARG_NONE, 4, Unknown, CopyLayout::None)),
    rt("cudaMemcpyFromSymbolAsync", form(2, 0, ARG_NONE, 4, Unknown, CopyLayout::None)),
    rt("cudaMemcpyFromSymbolAsync_ptsz", form(2, 0, ARG_NONE, 4, Unknown, CopyLayout::None)),
    // cudaMemcpyPeer*(dst, dstDevice, src, srcDevice, count[, stream]).
    rt("cudaMemcpyPeer", linear(4, D2D)),
    rt("cudaMemcpyPeerAsync", linear(4, D2D)),
    // cudaMemset*(ptr, value, count[, stream]); cudaMemset2D*(ptr, pitch, value, width, height[, stream]).
    rt("cudaMemset", linear(2, Memset)),
    rt("cudaMemset_ptds", linear(2, Memset)),
    rt("cudaMemsetAsync", linear(2, Memset)),
    rt("cudaMemsetAsync_ptsz", linear(2, Memset)),
    rt("cudaMemset2D", form(3, 0, 4, ARG_NONE, Memset, CopyLayout::None)),
    rt("cudaMemset2D_ptds", form(3, 0, 4, ARG_NONE, Memset, CopyLayout::None)),
    rt("cudaMemset2DAsync", form(3, 0, 4, ARG_NONE, Memset, CopyLayout::None)),
    rt("cudaMemset2DAsync_ptsz", form(3, 0, 4, ARG_NONE, Memset, CopyLayout::None)),
];

impl CopyForm {
    /// The attach cookie of entry `entry` with this form: the entry's index
    /// in bits 0–15, then 4 bits each for count, element shift, height, kind,
    /// fixed direction and layout.
    pub const fn cookie(self, entry: u16) -> u64 {
        entry as u64
            | (self.count as u64) << 16
            | (self.elem_shift as u64) << 20
            | (self.height as u64) << 24
            | (self.kind as u64) << 28
            | (self.fixed as u64) << 32
            | (self.layout as u64) << 36
    }

    /// The entry index and form a cookie holds (the kernel side's reading of it).
    pub fn of_cookie(cookie: u64) -> (u16, Self) {
        let nibble = |shift: u32| ((cookie >> shift) & 0xf) as u8;
        let layout = match nibble(36) {
            1 => CopyLayout::Driver2D,
            2 => CopyLayout::Driver3D,
            3 => CopyLayout::Runtime3D,
            _ => CopyLayout::None,
        };
        let form = Self {
            count: nibble(16),
            elem_shift: nibble(20),
            height: nibble(24),
            kind: nibble(28),
            fixed: CopyDirection::from_u8(nibble(32)),
            layout,
        };
        (cookie as u16, form)
    }
}

/// [`CopyRecord::kind`] when the call's arguments say nothing of its direction.
pub const NO_KIND: u32 = u32::MAX;

/// One copy or memset call, written at its return to the ordered ring with
/// the thread's sequence (so that it lands in the step its thread is in).
/// `header.ts_ns` is the return's time.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct CopyRecord {
    pub header: RecordHeader,
    /// As [`crate::OrderedRecord::seq`] / [`crate::OrderedRecord::depth`].
    pub seq: u32,
    pub depth: u32,
    /// `bpf_ktime_get_ns()` at the entry.
    pub start_ns: u64,
    /// Bytes written (count × element size, × height × depth for 2-D/3-D calls).
    pub bytes: u64,
    /// Index into [`COPY_ENTRIES`].
    pub entry: u32,
    /// What the arguments say of the direction: a runtime `cudaMemcpyKind`;
    /// for a driver descriptor, `src | dst << 8` of its `CUmemorytype`s; else [`NO_KIND`].
    pub kind: u32,
    /// The call's return value (`CUresult` / `cudaError_t`).
    pub result: u32,
    pub _pad: u32,
}

const _: () = assert!(core::mem::size_of::<CopyRecord>() == 64);
const _: () = assert!(COPY_ENTRIES.len() < u16::MAX as usize);

impl CopyEntry {
    /// The direction of a call of this entry whose record says `kind`.
    pub fn direction(&self, kind: u32) -> CopyDirection {
        match self.form.layout {
            CopyLayout::Driver2D | CopyLayout::Driver3D if kind != NO_KIND => {
                CopyDirection::of_memory_types(kind & 0xff, (kind >> 8) & 0xff)
            }
            CopyLayout::Runtime3D if kind != NO_KIND => CopyDirection::of_runtime_kind(kind),
            _ if self.form.kind != ARG_NONE && kind != NO_KIND => CopyDirection::of_runtime_kind(kind),
            _ => self.form.fixed,
        }
    }
}

/// Names of the copy programs.
pub mod copy_programs {
    /// Uprobe at a copy or memset entry point (cookie: [`super::CopyForm::cookie`]).
    pub const ENTER: &str = "copy_enter";
    /// Uretprobe at the same entry point: the record.
    pub const EXIT: &str = "copy_exit";
}

#[cfg(feature = "user")]
// SAFETY: plain-old-data: `#[repr(C)]`, no padding, every bit pattern valid.
unsafe impl aya::Pod for CopyRecord {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_survives_its_cookie() {
        for (i, e) in COPY_ENTRIES.iter().enumerate() {
            assert_eq!(CopyForm::of_cookie(e.form.cookie(i as u16)), (i as u16, e.form), "{}", e.symbol);
        }
    }

    #[test]
    fn symbols_are_unique() {
        for (i, a) in COPY_ENTRIES.iter().enumerate() {
            assert!(COPY_ENTRIES[i + 1..].iter().all(|b| b.symbol != a.symbol), "{}", a.symbol);
        }
    }

    #[test]
    fn directions_come_from_the_arguments_where_they_say_it() {
        let find = |s: &str| COPY_ENTRIES.iter().find(|e| e.symbol == s).copied().expect("entry");
        assert_eq!(find("cuMemcpyHtoD_v2").direction(NO_KIND), CopyDirection::HostToDevice);
        assert_eq!(find("cudaMemcpyAsync").direction(2), CopyDirection::DeviceToHost);
        assert_eq!(find("cudaMemcpy").direction(4), CopyDirection::Unknown);
        assert_eq!(find("cuMemcpy2D_v2").direction(1 | 2 << 8), CopyDirection::HostToDevice);
        assert_eq!(find("cuMemcpy3D_v2").direction(4 | 2 << 8), CopyDirection::Unknown);
        assert_eq!(find("cudaMemcpy3D").direction(3), CopyDirection::DeviceToDevice);
        assert_eq!(find("cudaMemset2D").direction(NO_KIND), CopyDirection::Memset);
        assert_eq!(find("cuMemcpy").direction(NO_KIND), CopyDirection::Unknown);
    }
}
