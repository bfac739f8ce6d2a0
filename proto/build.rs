fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/dataplane.proto");
    println!("cargo:rerun-if-changed=proto/manager.proto");
    // The RPC `Connect` would clash with the generated client's transport
    // constructor `connect`; clients build a Channel (Unix socket, port-forward
    // stream) themselves.
    tonic_prost_build::configure()
        .build_transport(false)
        .compile_protos(
            &["proto/dataplane.proto", "proto/manager.proto"],
            &["proto"],
        )?;
    Ok(())
}
