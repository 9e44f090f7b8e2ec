//! The consumer's side of cuBLAS/cuBLASLt calls: each GEMM's shape from its
//! arguments (or, for `cublasLtMatmul`, from the descriptors its thread's
//! process created and set before), FLOPs = 2·m·n·k·batch, attributed to the
//! step its thread is in; `gemms` rows (`--launches all`) and each step's sums.
use std::collections::HashMap;

use profiler_common::BlasCall;

use super::Consumer;
use crate::{
    correlate::mfu::{DEFAULT_PRECISION, Precision, dominant},
    events::BlasEvent,
    metrics::FlopsAt,
    store::{GemmRow, StepGemms, StoreMsg},
};

/// GEMM rows sent per batch.
const BATCH: usize = 4096;

/// cuBLASLt's `cublasLtMatrixLayoutAttribute_t` values read here.
mod layout_attr {
    pub const TYPE: u32 = 0;
    pub const ROWS: u32 = 2;
    pub const COLS: u32 = 3;
    pub const BATCH_COUNT: u32 = 5;
}

/// cuBLASLt's `cublasLtMatmulDescAttributes_t` values read here.
mod desc_attr {
    pub const COMPUTE_TYPE: u32 = 0;
    pub const TRANSA: u32 = 3;
}

/// A `cublasLtMatrixLayout_t`'s shape, as created and set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    data_type: u32,
    rows: u64,
    cols: u64,
    batch: u64,
}

/// A `cublasLtMatmulDesc_t`'s compute type and whether A is transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MatmulDesc {
    compute_type: u32,
    trans_a: bool,
}

/// One GEMM's shape and types.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Gemm {
    pub op: &'static str,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub batch: u64,
    pub data_type: Option<u32>,
    pub compute_type: Option<u32>,
}

impl Gemm {
    pub fn flops(&self) -> u64 {
        2u64.saturating_mul(self.m).saturating_mul(self.n).saturating_mul(self.k).saturating_mul(self.batch)
    }
}

/// The live cuBLASLt descriptors of the process, by handle.
#[derive(Default)]
pub(super) struct LtDescriptors {
    layouts: HashMap<u64, Layout>,
    descs: HashMap<u64, MatmulDesc>,
}

/// A step's GEMMs so far.
#[derive(Default)]
struct StepSums {
    flops: u64,
    calls: u64,
    /// FLOPs by (data type, compute type).
    by_types: HashMap<(Option<u32>, Option<u32>), u64>,
}

/// A (data type, compute type) pair's names and precision.
fn named_types(&(d, c): &(Option<u32>, Option<u32>)) -> (Option<String>, Option<String>, Option<Precision>) {
    let (d, c) = (d.map(data_type_name), c.map(compute_type_name));
    let p = Precision::of(d.as_deref(), c.as_deref());
    (d, c, p)
}

impl StepSums {
    /// The precision that did the most FLOPs, several type pairs of one
    /// precision counted together (as `correlate::mfu::dominant` picks it
    /// from the `gemms` rows at the end).
    fn precision(&self) -> Option<Precision> {
        let groups: Vec<(Option<Precision>, i64)> =
            self.by_types.iter().map(|(t, &f)| (named_types(t).2, i64::try_from(f).unwrap_or(i64::MAX))).collect();
        dominant(&groups).unwrap_or(Some(DEFAULT_PRECISION))
    }

    /// The types stored for the step (`steps.gemm_data_type`, …): of the
    /// dominant precision's pairs, the one with the most FLOPs (the lowest
    /// codes among equals), so that the MFU derived from them without
    /// `gemms` rows uses the precision the rows would give.
    fn dominant(&self) -> (Option<String>, Option<String>) {
        let precision = self.precision();
        let best = self
            .by_types
            .iter()
            .filter(|(t, _)| named_types(t).2 == precision)
            .max_by_key(|(types, flops)| (**flops, std::cmp::Reverse(**types)));
        best.map_or((None, None), |(t, _)| {
            let (d, c, _) = named_types(t);
            (d, c)
        })
    }
}

/// GEMM state and rows not yet sent (a field of the consumer).
#[derive(Default)]
pub(in crate::session) struct GemmState {
    /// `--launches all`: a row per call; else only the per-step sums.
    keep_rows: bool,
    lt: LtDescriptors,
    rows: Vec<GemmRow>,
    per_step: HashMap<(&'static str, u64), StepSums>,
    /// Steps ended since the last flush: their sums go to the store after
    /// their rows, and leave `per_step` (a step takes no GEMM after its end).
    ended: Vec<(&'static str, u64)>,
    /// `cublasLtMatmul` calls whose descriptors were not seen created (made
    /// before the session began): not counted.
    unknown_shapes: u64,
    /// A GEMM was seen in this process: a step without one did 0 FLOPs.
    any: bool,
}

impl GemmState {
    /// Step (`label`, `step`)'s GEMM FLOPs so far and their dominant
    /// precision; None while the process has issued no GEMM.
    pub fn step_flops(&self, label: &str, step: u64) -> Option<FlopsAt> {
        let per_step: &HashMap<(&str, u64), StepSums> = &self.per_step;
        self.any.then(|| match per_step.get(&(label, step)) {
            Some(s) => FlopsAt { flops: s.flops, precision: s.precision() },
            None => FlopsAt { flops: 0, precision: Some(DEFAULT_PRECISION) },
        })
    }
}

/// A 32-bit C `int` argument (the register's or slot's upper half is not the
/// caller's); negative: not a valid dimension.
fn int32(v: u64) -> Option<u64> {
    u64::try_from(v as u32 as i32).ok()
}

/// A 64-bit C `int64_t` argument.
fn int64(v: u64) -> Option<u64> {
    u64::try_from(v as i64).ok()
}

/// `cudaDataType_t` `CUDA_R_32F`, `CUDA_R_64F`, `CUDA_R_16F`.
const R_32F: u32 = 0;
const R_64F: u32 = 1;
const R_16F: u32 = 2;
/// `cublasComputeType_t` `CUBLAS_COMPUTE_16F`, `_32F`, `_64F`.
const COMPUTE_16F: u32 = 64;
const COMPUTE_32F: u32 = 68;
const COMPUTE_64F: u32 = 70;

/// The shape of a classic cuBLAS GEMM from its arguments: `(handle, transa,
/// transb, m, n, k, …)` with the types (and batch count) at fixed places.
fn classic(e: &BlasEvent) -> Option<Gemm> {
    use BlasCall::*;
    let wide =
        matches!(e.call, GemmEx64 | Sgemm64 | Dgemm64 | Hgemm64 | SgemmEx64 | GemmBatchedEx64 | GemmStridedBatchedEx64);
    let dim = |i: usize| if wide { int64(e.arg(i)) } else { int32(e.arg(i)) };
    let ty = |i: usize| Some(e.arg(i) as u32);
    // (data type, compute type, batch count) by where each entry point has them.
    let (data_type, compute_type, batch) = match e.call {
        GemmEx | GemmEx64 => (ty(8), ty(17), Some(1)),
        Sgemm | Sgemm64 => (Some(R_32F), Some(COMPUTE_32F), Some(1)),
        Dgemm | Dgemm64 => (Some(R_64F), Some(COMPUTE_64F), Some(1)),
        Hgemm | Hgemm64 => (Some(R_16F), Some(COMPUTE_16F), Some(1)),
        SgemmEx | SgemmEx64 => (ty(8), Some(COMPUTE_32F), Some(1)),
        GemmBatchedEx | GemmBatchedEx64 => (ty(8), ty(18), dim(17)),
        GemmStridedBatchedEx | GemmStridedBatchedEx64 => (ty(8), ty(21), dim(20)),
        _ => return None,
    };
    Some(Gemm { op: e.call.symbol(), m: dim(3)?, n: dim(4)?, k: dim(5)?, batch: batch?, data_type, compute_type })
}

impl LtDescriptors {
    /// Takes a descriptor call; for `cublasLtMatmul`, returns its GEMM (None
    /// when a descriptor it names was not seen created).
    fn take(&mut self, e: &BlasEvent) -> Option<Result<Gemm, ()>> {
        use BlasCall::*;
        match e.call {
            LtMatrixLayoutCreate if e.status == 0 => {
                let (rows, cols) = (e.arg(2), e.arg(3));
                self.layouts.insert(e.value, Layout { data_type: e.arg(1) as u32, rows, cols, batch: 1 });
            }
            LtMatmulDescCreate if e.status == 0 => {
                self.descs.insert(e.value, MatmulDesc { compute_type: e.arg(1) as u32, trans_a: false });
            }
            LtMatrixLayoutSetAttribute => {
                if let Some(l) = self.layouts.get_mut(&e.arg(0)) {
                    match e.arg(1) as u32 {
                        layout_attr::TYPE => l.data_type = e.value as u32,
                        layout_attr::ROWS => l.rows = e.value,
                        layout_attr::COLS => l.cols = e.value,
                        layout_attr::BATCH_COUNT => l.batch = int32(e.value).unwrap_or(0),
                        _ => {}
                    }
                }
            }
            LtMatmulDescSetAttribute => {
                if let Some(d) = self.descs.get_mut(&e.arg(0)) {
                    match e.arg(1) as u32 {
                        desc_attr::COMPUTE_TYPE => d.compute_type = e.value as u32,
                        // CUBLAS_OP_N is 0; T and C transpose.
                        desc_attr::TRANSA => d.trans_a = e.value as u32 != 0,
                        _ => {}
                    }
                }
            }
            LtMatrixLayoutDestroy => {
                self.layouts.remove(&e.arg(0));
            }
            LtMatmulDescDestroy => {
                self.descs.remove(&e.arg(0));
            }
            LtMatmul => return Some(self.matmul(e).ok_or(())),
            _ => {}
        }
        None
    }

    /// `cublasLtMatmul(handle, computeDesc, alpha, A, Adesc, B, Bdesc, beta,
    /// C, Cdesc, D, Ddesc, …)`: D is m×n, op(A) is m×k.
    fn matmul(&self, e: &BlasEvent) -> Option<Gemm> {
        let desc = self.descs.get(&e.arg(1))?;
        let a = self.layouts.get(&e.arg(4))?;
        let d = self.layouts.get(&e.arg(11))?;
        let k = if desc.trans_a { a.rows } else { a.cols };
        Some(Gemm {
            op: e.call.symbol(),
            m: d.rows,
            n: d.cols,
            k,
            batch: d.batch,
            data_type: Some(a.data_type),
            compute_type: Some(desc.compute_type),
        })
    }
}

/// A `cudaDataType_t`'s name (`library_types.h`).
pub(super) fn data_type_name(v: u32) -> String {
    const NAMES: [&str; 34] = [
        "CUDA_R_32F",
        "CUDA_R_64F",
        "CUDA_R_16F",
        "CUDA_R_8I",
        "CUDA_C_32F",
        "CUDA_C_64F",
        "CUDA_C_16F",
        "CUDA_C_8I",
        "CUDA_R_8U",
        "CUDA_C_8U",
        "CUDA_R_32I",
        "CUDA_C_32I",
        "CUDA_R_32U",
        "CUDA_C_32U",
        "CUDA_R_16BF",
        "CUDA_C_16BF",
        "CUDA_R_4I",
        "CUDA_C_4I",
        "CUDA_R_4U",
        "CUDA_C_4U",
        "CUDA_R_16I",
        "CUDA_C_16I",
        "CUDA_R_16U",
        "CUDA_C_16U",
        "CUDA_R_64I",
        "CUDA_C_64I",
        "CUDA_R_64U",
        "CUDA_C_64U",
        "CUDA_R_8F_E4M3",
        "CUDA_R_8F_E5M2",
        "CUDA_R_8F_UE8M0",
        "CUDA_R_6F_E2M3",
        "CUDA_R_6F_E3M2",
        "CUDA_R_4F_E2M1",
    ];
    NAMES.get(v as usize).map_or_else(|| format!("cudaDataType({v})"), |n| (*n).to_string())
}

/// A `cublasComputeType_t`'s name (`cublas_api.h`); below 64, the legacy
/// form that passes a `cudaDataType_t`.
pub(super) fn compute_type_name(v: u32) -> String {
    let name = match v {
        64 => "CUBLAS_COMPUTE_16F",
        65 => "CUBLAS_COMPUTE_16F_PEDANTIC",
        68 => "CUBLAS_COMPUTE_32F",
        69 => "CUBLAS_COMPUTE_32F_PEDANTIC",
        70 => "CUBLAS_COMPUTE_64F",
        71 => "CUBLAS_COMPUTE_64F_PEDANTIC",
        72 => "CUBLAS_COMPUTE_32I",
        73 => "CUBLAS_COMPUTE_32I_PEDANTIC",
        74 => "CUBLAS_COMPUTE_32F_FAST_16F",
        75 => "CUBLAS_COMPUTE_32F_FAST_16BF",
        77 => "CUBLAS_COMPUTE_32F_FAST_TF32",
        v if v < 64 => return data_type_name(v),
        v => return format!("cublasComputeType({v})"),
    };
    name.to_string()
}

impl Consumer {
    /// `--launches all`: a `gemms` row per call; otherwise only the per-step sums.
    pub(in crate::session) fn keep_gemm_rows(&mut self, keep: bool) {
        self.gemms.keep_rows = keep;
    }

    /// A cuBLAS/cuBLASLt call: a descriptor's change, or a GEMM, counted
    /// toward the step its thread is in.
    pub(super) fn blas(&mut self, e: &BlasEvent) {
        let gemm = match e.call.is_lt() {
            false => classic(e),
            true => match self.gemms.lt.take(e) {
                Some(Ok(g)) => Some(g),
                Some(Err(())) => {
                    self.gemms.unknown_shapes += 1;
                    None
                }
                None => None,
            },
        };
        let Some(g) = gemm else { return };
        let step = self.tracker.current_step(e.tid);
        let flops = g.flops();
        self.gemms.any = true;
        if let Some(live) = &mut self.live {
            live.gemm(flops);
        }
        if let Some((label, n)) = step {
            let sums = self.gemms.per_step.entry((label, n)).or_default();
            sums.flops = sums.flops.saturating_add(flops);
            sums.calls += 1;
            let by_types = sums.by_types.entry((g.data_type, g.compute_type)).or_default();
            *by_types = by_types.saturating_add(flops);
        }
        if self.gemms.keep_rows {
            self.gemms.rows.push(GemmRow {
                ts_ns: e.ts_ns,
                tid: e.tid,
                op: g.op,
                m: g.m,
                n: g.n,
                k: g.k,
                batch: g.batch,
                flops,
                data_type: g.data_type.map(data_type_name),
                compute_type: g.compute_type.map(compute_type_name),
                step,
            });
            if self.gemms.rows.len() >= BATCH {
                self.flush_gemms();
            }
        }
    }

    /// Sends the GEMM rows.
    pub(super) fn flush_gemms(&mut self) {
        if !self.gemms.rows.is_empty() {
            self.writer.send(StoreMsg::Gemms(std::mem::take(&mut self.gemms.rows)));
        }
        let ended = std::mem::take(&mut self.gemms.ended);
        let per_step = &mut self.gemms.per_step;
        let sums: Vec<StepGemms> =
            ended.into_iter().filter_map(|k| per_step.remove(&k).map(|s| step_gemms(k, s))).collect();
        if !sums.is_empty() {
            self.writer.send(StoreMsg::StepGemmsSoFar(sums));
        }
    }

    /// Step (`label`, `step`) has ended (its row is among those flushed next).
    pub(super) fn gemm_step_ended(&mut self, label: &'static str, step: u64) {
        if self.gemms.any {
            self.gemms.ended.push((label, step));
        }
    }

    /// Sends every step's sums: once, after the last step row.
    pub(super) fn finish_gemms(&mut self) {
        if self.gemms.unknown_shapes > 0 {
            log::warn!(
                "{} cublasLtMatmul calls used descriptors created before the session began: not counted",
                self.gemms.unknown_shapes
            );
        }
        let sums: Vec<StepGemms> = self.gemms.per_step.drain().map(|(k, s)| step_gemms(k, s)).collect();
        self.writer.send(StoreMsg::StepGemms(sums));
    }
}

fn step_gemms((label, step): (&'static str, u64), s: StepSums) -> StepGemms {
    let (data_type, compute_type) = s.dominant();
    StepGemms { label, step, flops: s.flops, calls: s.calls, data_type, compute_type }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(call: BlasCall, args: &[u64]) -> BlasEvent {
        let mut e = BlasEvent { ts_ns: 1, tid: 2, tgid: 2, call, status: 0, args: [0; 6], stack: [0; 16], value: 0 };
        for (i, v) in args.iter().enumerate() {
            if i < 6 {
                e.args[i] = *v;
            } else if let Some(slot) = e.stack.get_mut(i - 6) {
                // Past the slots kept: the arguments no decoder reads (`algo`).
                *slot = *v;
            }
        }
        e
    }

    /// Argument lists with `m, n, k` at 3..6 and `fill` elsewhere, `at` set.
    fn args(len: usize, mnk: [u64; 3], at: &[(usize, u64)]) -> Vec<u64> {
        let mut v = vec![0xdead_0000_0000_0000; len];
        v[3..6].copy_from_slice(&mnk);
        for &(i, x) in at {
            v[i] = x;
        }
        v
    }

    #[test]
    fn classic_gemms_read_their_arguments_and_only_the_low_half_of_an_int() {
        // Garbage in the upper halves of 32-bit dims (as a caller may leave them).
        let g = classic(&event(
            BlasCall::GemmEx,
            &args(19, [0xffff_0000_0000_0040, 0x1_0000_0020, 8], &[(8, 14), (17, 68)]),
        ))
        .expect("gemm");
        assert_eq!((g.m, g.n, g.k, g.batch, g.flops()), (64, 32, 8, 1, 2 * 64 * 32 * 8));
        assert_eq!((g.data_type, g.compute_type), (Some(14), Some(68)));
        let g = classic(&event(BlasCall::GemmEx64, &args(19, [1 << 33, 2, 3], &[(8, 0), (17, 68)]))).expect("gemm");
        assert_eq!(g.m, 1 << 33);
        let g = classic(&event(
            BlasCall::GemmStridedBatchedEx,
            &args(23, [4, 5, 6], &[(8, 2), (20, 0xffff_ffff_0000_0007), (21, 64)]),
        ))
        .expect("gemm");
        assert_eq!((g.batch, g.flops(), g.compute_type), (7, 2 * 4 * 5 * 6 * 7, Some(64)));
        let g = classic(&event(BlasCall::GemmBatchedEx, &args(20, [4, 5, 6], &[(17, 3), (18, 68)]))).expect("gemm");
        assert_eq!(g.batch, 3);
        let g = classic(&event(BlasCall::Hgemm, &args(14, [2, 2, 2], &[]))).expect("gemm");
        assert_eq!((g.data_type, g.compute_type), (Some(R_16F), Some(COMPUTE_16F)));
        // A negative dimension is no GEMM (cuBLAS refuses it).
        assert_eq!(classic(&event(BlasCall::Sgemm, &args(14, [u32::MAX as u64, 2, 2], &[]))), None);
    }

    #[test]
    fn lt_matmul_takes_its_shape_from_the_descriptors_until_they_are_destroyed() {
        let mut lt = LtDescriptors::default();
        let mut create = |call, handle, a: &[u64]| {
            let mut e = event(call, a);
            e.value = handle;
            assert_eq!(lt.take(&e), None);
        };
        // A (k×m = 16×8, transposed), B, D (m×n = 8×4), bf16, compute 32F.
        create(BlasCall::LtMatrixLayoutCreate, 0xa, &[0, 14, 16, 8, 16]);
        create(BlasCall::LtMatrixLayoutCreate, 0xd, &[0, 14, 8, 4, 8]);
        create(BlasCall::LtMatmulDescCreate, 0xc, &[0, 68, 0]);
        let mut set = |call, handle, attr, value| {
            let mut e = event(call, &[handle, attr]);
            e.value = value;
            assert_eq!(lt.take(&e), None);
        };
        set(BlasCall::LtMatmulDescSetAttribute, 0xc, u64::from(desc_attr::TRANSA), 1);
        set(BlasCall::LtMatrixLayoutSetAttribute, 0xd, u64::from(layout_attr::BATCH_COUNT), 3);
        let matmul = event(BlasCall::LtMatmul, &[0, 0xc, 0, 0, 0xa, 0, 0xb, 0, 0, 0xd, 0, 0xd]);
        let g = lt.take(&matmul).expect("a matmul").expect("known descriptors");
        assert_eq!((g.m, g.n, g.k, g.batch), (8, 4, 16, 3));
        assert_eq!((g.data_type, g.compute_type), (Some(14), Some(68)));
        assert_eq!(lt.take(&event(BlasCall::LtMatrixLayoutDestroy, &[0xd])), None);
        assert_eq!(lt.take(&matmul), Some(Err(())), "D is gone");
    }

    /// The ring's bytes of a record, at an odd address (the ring aligns to 8
    /// bytes, not to the record), decode to the arguments by C position.
    #[test]
    fn a_blas_record_decodes_to_its_arguments() {
        use profiler_common::{BlasRecord, RecordHeader, RecordKind};
        use zerocopy::IntoBytes;
        let mut stack = [0u64; 16];
        stack[14] = 5; // argument 20: cublasGemmStridedBatchedEx's batchCount
        let r = BlasRecord {
            header: RecordHeader { kind: RecordKind::Blas as u32, tid: 9, ts_ns: 77, tgid: 9, _pad: 0 },
            call: BlasCall::GemmStridedBatchedEx as u32,
            status: 0,
            args: [0, 0, 0, 6, 7, 8],
            ret: 0x1234,
            stack,
            value: 0,
        };
        let mut bytes = vec![0u8];
        bytes.extend(r.as_bytes());
        let Ok(crate::events::Event::Blas(e)) = crate::events::decode(&bytes[1..]) else { panic!("a BLAS event") };
        assert_eq!((e.tid, e.ts_ns, e.arg(3), e.arg(20), e.arg(40)), (9, 77, 6, 5, 0));
        assert_eq!(classic(&e).map(|g| (g.m, g.n, g.k, g.batch)), Some((6, 7, 8, 5)));
        let bad = BlasRecord { call: 999, ..r };
        assert!(crate::events::decode(bad.as_bytes()).is_err());
    }

    #[test]
    fn type_names_are_cublas_names() {
        assert_eq!(data_type_name(14), "CUDA_R_16BF");
        assert_eq!(data_type_name(28), "CUDA_R_8F_E4M3");
        assert_eq!(data_type_name(99), "cudaDataType(99)");
        assert_eq!(compute_type_name(77), "CUBLAS_COMPUTE_32F_FAST_TF32");
        assert_eq!(compute_type_name(0), "CUDA_R_32F");
        assert_eq!(compute_type_name(200), "cublasComputeType(200)");
    }

    /// The live MFU's precision per step: the one that did most of the step's
    /// FLOPs, several type pairs of one precision counted together; the
    /// default for a step without GEMMs; None before any GEMM.
    #[test]
    fn a_steps_precision_is_the_one_with_most_flops() {
        let mut g = GemmState::default();
        assert_eq!(g.step_flops("train", 0), None, "no GEMM in the process yet");
        g.any = true;
        let sums = g.per_step.entry(("train", 0)).or_default();
        // 30 FLOPs of FP32, 25 + 25 of BF16 (data 16BF, compute 32F and FAST_16BF): BF16.
        sums.by_types = HashMap::from([((Some(R_32F), Some(COMPUTE_32F)), 30), ((Some(14), Some(68)), 25)]);
        sums.by_types.insert((Some(R_32F), Some(75)), 25);
        sums.flops = 80;
        assert_eq!(g.step_flops("train", 0), Some(FlopsAt { flops: 80, precision: Some(Precision::Bf16) }));
        // The types stored for it are a BF16 pair (of two equal ones, the lower codes: FP32 data with
        // FAST_16BF compute), not the FP32 pair that did the most FLOPs alone.
        let stored = (Some("CUDA_R_32F".into()), Some("CUBLAS_COMPUTE_32F_FAST_16BF".into()));
        assert_eq!(g.per_step[&("train", 0)].dominant(), stored);
        assert_eq!(
            g.step_flops("train", 1),
            Some(FlopsAt { flops: 0, precision: Some(DEFAULT_PRECISION) }),
            "a step without GEMMs"
        );
        // Types no precision is known for: none.
        let sums = g.per_step.entry(("train", 2)).or_default();
        sums.by_types = HashMap::from([((Some(99), None), 10)]);
        assert_eq!(g.step_flops("train", 2).map(|f| f.precision), Some(None));
    }
}
