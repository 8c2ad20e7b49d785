//! NVRTC compiles every kernel for Hopper and Blackwell without a GPU, a broken kernel fails with
//! NVRTC's log, and the driver probe answers without panicking whether or not CUDA is installed.

#![cfg(feature = "cuda")]

use rackfill_kernels::cuda::nvrtc::{self, CompileFailure, KernelSource, Output};
use rackfill_kernels::cuda::{probe, CudaUnavailable, NvrtcUnavailable};

/// `None` (after printing why) when NVRTC cannot be loaded on this machine.
fn nvrtc_or_skip(test: &str) -> Option<(i32, i32)> {
    match nvrtc::nvrtc_version() {
        Ok(v) => Some(v),
        Err(why @ NvrtcUnavailable::NotFound { .. }) => {
            eprintln!("{test}: skipped, {why}");
            None
        }
        Err(other) => panic!("{test}: NVRTC is present but unusable: {other}"),
    }
}

#[test]
fn every_kernel_compiles_for_hopper_and_blackwell() {
    let Some((major, _)) = nvrtc_or_skip("every_kernel_compiles_for_hopper_and_blackwell") else {
        return;
    };
    assert!(major >= 12, "NVRTC {major} is too old for sm_90");
    for arch in nvrtc::DEFAULT_ARCHS {
        for source in nvrtc::SOURCES {
            let ptx = nvrtc::compile(&source, arch)
                .unwrap_or_else(|e| panic!("{} for {arch}: {e}", source.name));
            assert!(
                ptx.bytes > 1000,
                "{} for {arch}: {} bytes",
                source.name,
                ptx.bytes
            );
        }
    }
}

#[test]
fn every_kernel_compiles_to_machine_code_as_gpus_load_it() {
    if nvrtc_or_skip("every_kernel_compiles_to_machine_code").is_none() {
        return;
    }
    for arch in nvrtc::DEFAULT_ARCHS {
        for source in nvrtc::SOURCES {
            let cubin = nvrtc::compile_to(&source, arch, Output::Cubin)
                .unwrap_or_else(|e| panic!("{} for {arch}: {e}", source.name));
            assert!(cubin.bytes > 1000, "{} for {arch}", source.name);
        }
    }
}

#[test]
fn a_broken_kernel_reports_the_nvrtc_log_with_its_own_line_numbers() {
    if nvrtc_or_skip("a_broken_kernel_reports_the_nvrtc_log").is_none() {
        return;
    }
    let broken = KernelSource {
        name: "broken",
        file: "broken.cu",
        source: "extern \"C\" __global__ void k(u32* x) {\n    x[0] = undeclared_name;\n}\n",
        entry_points: &["k"],
    };
    match nvrtc::compile(&broken, "sm_90") {
        Err(CompileFailure::Source { kernel, arch, log }) => {
            assert_eq!((kernel, arch.as_str()), ("broken", "sm_90"));
            assert!(log.contains("undeclared_name"), "{log}");
            // Line 2 of broken.cu, not of the prelude + file.
            assert!(log.contains("broken.cu(2)"), "{log}");
        }
        other => panic!("expected a compile failure, got {other:?}"),
    }
}

#[test]
fn bad_architectures_are_refused_before_nvrtc_runs() {
    for arch in ["", "sm_9", "compute_90", "gfx90a"] {
        match nvrtc::compile(&nvrtc::PERMUTE, arch) {
            Err(CompileFailure::Unavailable(NvrtcUnavailable::BadArch { arch: got })) => {
                assert_eq!(got, arch)
            }
            other => panic!("{arch}: {other:?}"),
        }
    }
}

#[test]
fn the_probe_never_panics_and_explains_a_missing_gpu() {
    match probe() {
        Ok(info) => {
            assert!(
                info.devices >= 1 && info.compute_capability.0 >= 7,
                "{info}"
            );
            assert!(info.arch().starts_with("sm_"));
        }
        Err(why) => {
            let text = why.to_string();
            assert!(!text.is_empty());
            if let CudaUnavailable::NoDriver { searched } = &why {
                assert!(searched.contains("libcuda.so.1"), "{searched}");
            }
            eprintln!("no GPU here: {text}");
        }
    }
    // Asking twice gives the same answer (library lookups are cached, nothing half-initialised).
    assert_eq!(probe().is_ok(), probe().is_ok());
}
