//! Model-FLOPs utilisation per step and GPU: the GEMM FLOPs a step issued
//! (`steps.flops`), split across the GPUs it used, over what the GPU could
//! have done in the step's time at its peak dense rate for the step's
//! dominant precision; and an estimate from NVML GPM's tensor activity.
//!
//! The peaks are NVIDIA's datasheet figures, dense (a figure the datasheet
//! gives "with sparsity" is halved), in TFLOP/s (TOPS for INT8).

/// The precision a GEMM runs at, as far as the GPU's peak rate goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Precision {
    Fp64,
    Fp32,
    Tf32,
    Bf16,
    Fp16,
    Fp8,
    Int8,
}

impl Precision {
    /// The precision of a GEMM from cuBLAS's names of its data type
    /// (`CUDA_R_16BF`, …) and compute type (`CUBLAS_COMPUTE_32F_FAST_TF32`, …);
    /// None when neither says. A `_FAST_*` compute type decides (FP32 data run
    /// on tensor cores); otherwise the data type, then the compute type.
    pub fn of(data_type: Option<&str>, compute_type: Option<&str>) -> Option<Self> {
        let compute = compute_type.map(str::to_ascii_uppercase).unwrap_or_default();
        let data = data_type.map(str::to_ascii_uppercase).unwrap_or_default();
        let fast = [("FAST_TF32", Self::Tf32), ("FAST_16BF", Self::Bf16), ("FAST_16F", Self::Fp16)];
        if let Some(&(_, p)) = fast.iter().find(|(k, _)| compute.contains(k)) {
            return Some(p);
        }
        Self::of_type(&data).or_else(|| Self::of_type(&compute))
    }

    /// A cudaDataType or cublasComputeType name.
    fn of_type(name: &str) -> Option<Self> {
        // Longer names first: "16BF" before "16F", "8F_" before "8I".
        let table = [
            ("16BF", Self::Bf16),
            ("16F", Self::Fp16),
            ("8F_", Self::Fp8),
            ("8I", Self::Int8),
            ("32I", Self::Int8),
            ("64F", Self::Fp64),
            ("TF32", Self::Tf32),
            ("32F", Self::Fp32),
        ];
        table.iter().find(|(k, _)| name.contains(k)).map(|&(_, p)| p)
    }
}

/// A GPU's dense peaks, TFLOP/s; None where the datasheet gives none.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Peaks {
    /// Token of the NVML name that names the model.
    pub model: &'static str,
    /// Token that names the form factor (`PCIE`, `NVL`); None: the SXM form (or the only one).
    pub form: Option<&'static str>,
    /// The NVIDIA document the figures come from.
    pub source: &'static str,
    /// FP64 on tensor cores where the GPU has them (DGEMM uses them).
    pub fp64: Option<f64>,
    pub fp32: Option<f64>,
    pub tf32: Option<f64>,
    pub bf16: Option<f64>,
    pub fp16: Option<f64>,
    pub fp8: Option<f64>,
    pub int8: Option<f64>,
}

const H100_SXM: Peaks = Peaks {
    model: "H100",
    form: None,
    source: "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)",
    fp64: Some(67.0),
    fp32: Some(67.0),
    tf32: Some(494.5),
    bf16: Some(989.5),
    fp16: Some(989.5),
    fp8: Some(1979.0),
    int8: Some(1979.0),
};

const H100_NVL: Peaks = Peaks {
    form: Some("NVL"),
    source: "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL)",
    fp64: Some(60.0),
    fp32: Some(60.0),
    tf32: Some(417.5),
    bf16: Some(835.5),
    fp16: Some(835.5),
    fp8: Some(1670.5),
    int8: Some(1670.5),
    ..H100_SXM
};

const A100: Peaks = Peaks {
    model: "A100",
    form: None,
    source: "NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe alike)",
    fp64: Some(19.5),
    fp32: Some(19.5),
    tf32: Some(156.0),
    bf16: Some(312.0),
    fp16: Some(312.0),
    fp8: None,
    int8: Some(624.0),
};

/// Dense peaks by GPU model and form factor.
pub const PEAKS: &[Peaks] = &[
    H100_SXM,
    Peaks {
        form: Some("PCIE"),
        source: "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe)",
        fp64: Some(51.0),
        fp32: Some(51.0),
        tf32: Some(378.0),
        bf16: Some(756.5),
        fp16: Some(756.5),
        fp8: Some(1513.0),
        int8: Some(1513.0),
        ..H100_SXM
    },
    H100_NVL,
    Peaks { model: "H200", source: "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)", ..H100_SXM },
    Peaks { model: "H200", source: "NVIDIA H200 Tensor Core GPU datasheet (H200 NVL)", ..H100_NVL },
    Peaks { model: "GH200", source: "NVIDIA GH200 Grace Hopper Superchip datasheet", ..H100_SXM },
    A100,
    Peaks {
        model: "L40S",
        source: "NVIDIA L40S GPU datasheet",
        fp64: None,
        fp32: Some(91.6),
        tf32: Some(183.0),
        bf16: Some(362.05),
        fp16: Some(362.05),
        fp8: Some(733.0),
        int8: Some(733.0),
        ..A100
    },
    Peaks {
        model: "L4",
        source: "NVIDIA L4 Tensor Core GPU datasheet",
        fp64: None,
        fp32: Some(30.3),
        tf32: Some(60.0),
        bf16: Some(121.0),
        fp16: Some(121.0),
        fp8: Some(242.5),
        int8: Some(242.5),
        ..A100
    },
    Peaks {
        model: "A10",
        source: "NVIDIA A10 Tensor Core GPU datasheet",
        fp64: None,
        fp32: Some(31.2),
        tf32: Some(62.5),
        bf16: Some(125.0),
        fp16: Some(125.0),
        fp8: None,
        int8: Some(250.0),
        ..A100
    },
    Peaks {
        model: "B200",
        source: "NVIDIA HGX B200 datasheet (8-GPU figures / 8)",
        fp64: Some(37.0),
        fp32: Some(75.0),
        tf32: Some(1125.0),
        bf16: Some(2250.0),
        fp16: Some(2250.0),
        fp8: Some(4500.0),
        int8: Some(4500.0),
        ..A100
    },
];

impl Peaks {
    /// The peaks of the GPU NVML calls `name` ("NVIDIA H100 80GB HBM3",
    /// "NVIDIA A100-SXM4-80GB", "NVIDIA H100 PCIe"); None for a GPU not in
    /// [`PEAKS`]. Whole tokens only: an A10G is not an A10.
    pub fn of_gpu(name: &str) -> Option<&'static Peaks> {
        let upper = name.to_ascii_uppercase();
        let tokens: Vec<&str> = upper.split(|c: char| !c.is_ascii_alphanumeric()).filter(|t| !t.is_empty()).collect();
        let models = || PEAKS.iter().filter(|p| tokens.contains(&p.model));
        models().find(|p| p.form.is_some_and(|f| tokens.contains(&f))).or_else(|| models().find(|p| p.form.is_none()))
    }

    /// Peak dense FLOP/s at `precision`.
    pub fn flops_per_s(&self, precision: Precision) -> Option<f64> {
        let tflops = match precision {
            Precision::Fp64 => self.fp64,
            Precision::Fp32 => self.fp32,
            Precision::Tf32 => self.tf32,
            Precision::Bf16 => self.bf16,
            Precision::Fp16 => self.fp16,
            Precision::Fp8 => self.fp8,
            Precision::Int8 => self.int8,
        };
        tflops.map(|t| t * 1e12)
    }
}

/// The precision that carried most of a step's GEMM FLOPs, from
/// (precision, FLOPs) per group of its GEMMs; `Some(None)` when that is a
/// precision nobody could name. None when the step has no GEMM rows: then
/// [`DEFAULT_PRECISION`] applies.
pub fn dominant(groups: &[(Option<Precision>, i64)]) -> Option<Option<Precision>> {
    let mut sums: std::collections::BTreeMap<Option<Precision>, i64> = Default::default();
    for &(p, f) in groups {
        let sum = sums.entry(p).or_default();
        *sum = sum.saturating_add(f);
    }
    // Ties go to the first in the map's order, so the answer never depends on row order.
    sums.into_iter().rev().max_by_key(|&(_, f)| f).map(|(p, _)| p)
}

/// Without GEMM rows (`--launches count` keeps only per-step sums), a step's
/// FLOPs are taken to run at BF16/FP16 — what mixed-precision training uses.
pub const DEFAULT_PRECISION: Precision = Precision::Bf16;

/// `flops` split across `n` GPUs: equal shares, the remainder on the first,
/// so that the shares add up to `flops` exactly.
pub fn split(flops: i64, n: usize) -> Vec<i64> {
    let Ok(k) = i64::try_from(n) else { return Vec::new() };
    if k == 0 {
        return Vec::new();
    }
    let mut shares = vec![flops / k; n];
    shares[0] += flops % k;
    shares
}

/// `flops` over what `peak_flops_per_s` does in `duration_ns`, in percent.
pub fn mfu_pct(flops: i64, peak_flops_per_s: f64, duration_ns: u64) -> Option<f64> {
    (duration_ns > 0 && peak_flops_per_s > 0.0)
        .then(|| 100.0 * flops as f64 / (peak_flops_per_s * duration_ns as f64 / 1e9))
}

/// The GPM estimate of MFU, in percent: the share of time tensor cores were
/// busy, scaled by how far the SM clock ran below its maximum. An estimate:
/// a busy tensor core is not necessarily one at its peak rate.
pub fn mfu_gpm_pct(tensor_util_pct: f64, sm_clock_mhz: f64, max_sm_clock_mhz: f64) -> Option<f64> {
    (max_sm_clock_mhz > 0.0).then(|| tensor_util_pct * sm_clock_mhz / max_sm_clock_mhz)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_are_named_by_whole_tokens_and_form_factor() {
        let model = |n: &str| Peaks::of_gpu(n).map(|p| (p.model, p.form));
        assert_eq!(model("NVIDIA H100 80GB HBM3"), Some(("H100", None)));
        assert_eq!(model("NVIDIA H100 PCIe"), Some(("H100", Some("PCIE"))));
        assert_eq!(model("NVIDIA H100 NVL"), Some(("H100", Some("NVL"))));
        assert_eq!(model("NVIDIA H200"), Some(("H200", None)));
        assert_eq!(model("NVIDIA H200 NVL"), Some(("H200", Some("NVL"))));
        assert_eq!(model("NVIDIA A100-SXM4-80GB"), Some(("A100", None)));
        assert_eq!(model("NVIDIA A100 80GB PCIe"), Some(("A100", None)), "one A100 row for both forms");
        assert_eq!(model("NVIDIA L40S"), Some(("L40S", None)));
        assert_eq!(model("NVIDIA L4"), Some(("L4", None)));
        assert_eq!(model("NVIDIA A10"), Some(("A10", None)));
        assert_eq!(model("NVIDIA B200"), Some(("B200", None)));
        assert_eq!(model("NVIDIA GH200 480GB"), Some(("GH200", None)));
        for unknown in ["NVIDIA A10G", "Tesla T4", "NVIDIA GeForce RTX 4090", ""] {
            assert_eq!(model(unknown), None, "{unknown}");
        }
        let h100 = Peaks::of_gpu("NVIDIA H100 80GB HBM3").expect("H100");
        assert_eq!(h100.flops_per_s(Precision::Bf16), Some(989.5e12));
        assert_eq!(Peaks::of_gpu("NVIDIA A100-PCIE-40GB").and_then(|p| p.flops_per_s(Precision::Fp8)), None);
    }

    #[test]
    fn precision_from_cublas_names() {
        let p = |d: Option<&str>, c: Option<&str>| Precision::of(d, c);
        assert_eq!(p(Some("CUDA_R_16BF"), Some("CUBLAS_COMPUTE_32F")), Some(Precision::Bf16));
        assert_eq!(p(Some("CUDA_R_16F"), Some("CUBLAS_COMPUTE_16F")), Some(Precision::Fp16));
        assert_eq!(p(Some("CUDA_R_32F"), Some("CUBLAS_COMPUTE_32F_FAST_TF32")), Some(Precision::Tf32));
        assert_eq!(p(Some("CUDA_R_32F"), Some("CUBLAS_COMPUTE_32F_FAST_16BF")), Some(Precision::Bf16));
        assert_eq!(p(Some("CUDA_R_32F"), Some("CUBLAS_COMPUTE_32F")), Some(Precision::Fp32));
        assert_eq!(p(Some("CUDA_R_32F"), Some("CUBLAS_COMPUTE_32F_PEDANTIC")), Some(Precision::Fp32));
        assert_eq!(p(Some("CUDA_R_64F"), None), Some(Precision::Fp64));
        assert_eq!(p(Some("CUDA_R_8F_E4M3"), Some("CUBLAS_COMPUTE_32F")), Some(Precision::Fp8));
        assert_eq!(p(Some("CUDA_R_8I"), Some("CUBLAS_COMPUTE_32I")), Some(Precision::Int8));
        assert_eq!(p(None, Some("CUBLAS_COMPUTE_64F")), Some(Precision::Fp64));
        assert_eq!(p(Some("type 99"), None), None);
        assert_eq!(p(None, None), None);
    }

    #[test]
    fn the_dominant_precision_carries_most_flops() {
        let bf16 = Some(Precision::Bf16);
        let fp32 = Some(Precision::Fp32);
        assert_eq!(dominant(&[(fp32, 10), (bf16, 30), (fp32, 15)]), Some(bf16));
        assert_eq!(dominant(&[(fp32, 40), (bf16, 30), (None, 5)]), Some(fp32));
        assert_eq!(dominant(&[(None, 40), (bf16, 30)]), Some(None), "unknown types win: no MFU, not a wrong one");
        assert_eq!(dominant(&[]), None);
    }

    #[test]
    fn flops_split_exactly_and_mfu_is_flops_over_peak_time() {
        assert_eq!(split(10, 3), [4, 3, 3]);
        assert_eq!(split(9, 1), [9]);
        assert!(split(9, 0).is_empty());
        // 989.5 TFLOP/s for 10 ms is 9.895 TFLOP; a step that issued 4.9475 TFLOP used half.
        let h100 = Peaks::of_gpu("NVIDIA H100 80GB HBM3").and_then(|p| p.flops_per_s(Precision::Bf16));
        let mfu = mfu_pct(4_947_500_000_000, h100.expect("peak"), 10_000_000).expect("mfu");
        assert!((mfu - 50.0).abs() < 1e-9, "{mfu}");
        assert_eq!(mfu_pct(1, 1e12, 0), None);
        assert_eq!(mfu_gpm_pct(40.0, 1485.0, 1980.0), Some(30.0));
        assert_eq!(mfu_gpm_pct(40.0, 1485.0, 0.0), None);
    }
}
