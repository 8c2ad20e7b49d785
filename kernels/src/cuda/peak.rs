//! The dense bf16 tensor-core peak of the GPUs rackfill runs on: the denominator of every
//! "fraction of the card's peak" and model-FLOP-utilisation figure the benchmarks report.
//!
//! Datasheet figures without sparsity, at the boost clock (NVIDIA's product pages). A card not
//! in the table gets no fraction unless the user names its peak (`--peak-tflops`).

/// `(substring of the device name, dense bf16 TFLOP/s)`, most specific first.
const PEAKS: [(&str, f64); 10] = [
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("L40S", 362.0),
];

/// The dense bf16 peak in TFLOP/s of the GPU whose name (as the driver reports it, e.g.
/// "NVIDIA H100 80GB HBM3") is `device`, if the table knows it.
pub fn dense_bf16_peak_tflops(device: &str) -> Option<f64> {
    PEAKS
        .iter()
        .find(|(name, _)| device.contains(name))
        .map(|&(_, peak)| peak)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_specific_name_wins() {
        assert_eq!(
            dense_bf16_peak_tflops("NVIDIA H100 80GB HBM3 (sm_90)"),
            Some(989.0)
        );
        assert_eq!(
            dense_bf16_peak_tflops("NVIDIA H100 PCIe (sm_90)"),
            Some(756.0)
        );
        assert_eq!(dense_bf16_peak_tflops("NVIDIA H200 (sm_90)"), Some(989.0));
        assert_eq!(dense_bf16_peak_tflops("NVIDIA GH200 480GB"), Some(989.0));
        assert_eq!(dense_bf16_peak_tflops("NVIDIA B200"), Some(2250.0));
        assert_eq!(dense_bf16_peak_tflops("host emulator"), None);
    }
}
