fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/dataplane.proto");
    println!("cargo:rerun-if-changed=proto/manager.proto");
    println!("cargo:rerun-if-changed=proto/userd.proto");
    // The RPC `Connect` would clash with the generated client's transport
    // constructor `connect` (hence `build_transport(false)` in both calls);
    // clients build a Channel (Unix socket, port-forward stream) themselves.
    //
    // The user daemon's API reuses the root daemon's messages: refer to the
    // `dataplane` module instead of generating them twice. First: protoc also
    // writes the imported package's file, which the next call then overwrites
    // with the complete one.
    tonic_prost_build::configure()
        .build_transport(false)
        .extern_path(".kvpn.dataplane.v1", "crate::dataplane")
        .compile_protos(&["proto/userd.proto"], &["proto"])?;
    tonic_prost_build::configure()
        .build_transport(false)
        .compile_protos(
            &["proto/dataplane.proto", "proto/manager.proto"],
            &["proto"],
        )?;
    Ok(())
}
