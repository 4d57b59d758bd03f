//! Build script shared by every crate that links tch into binaries or tests.
//!
//! torch-sys embeds no rpath and rustc's `--as-needed` drops libtorch_cuda, so
//! a plain `cargo run`/`cargo test` would neither find libtorch nor see CUDA.
//! This script adds an rpath to the libtorch that torch-sys built against
//! (exported as `DEP_TCH_LIBTORCH_LIB`) and, when the CUDA libraries are
//! installed beside it, force-links libtorch_cuda. `TCH_LINK_CUDA=1` forces
//! the CUDA link (building here for a GPU machine), `TCH_LINK_CUDA=0` stops it.
//! `rustc-link-arg` does not propagate to dependents, hence one copy per crate.

use std::path::Path;

fn main() {
    println!("cargo:rerun-if-env-changed=TCH_LINK_CUDA");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    let lib = Path::new(&lib);
    // cudarc dlopens NCCL/cuBLAS; the pip wheels keep them under
    // nvidia/cu13/lib, and NCCL (by wheel) under nvidia/nccl/lib: found
    // there, it is the NCCL libtorch_cuda loads, never a second one.
    let nvidia = lib.join("../../nvidia/cu13/lib");
    for dir in [lib.join("../../nvidia/nccl/lib"), nvidia.clone()] {
        if dir.is_dir() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
        }
    }
    let cuda_installed = nvidia.join("libcublas.so.13").exists();
    let link_cuda = match std::env::var("TCH_LINK_CUDA").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => cuda_installed,
    };
    if link_cuda && lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}
