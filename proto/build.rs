fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/dataplane.proto");
    tonic_prost_build::configure().compile_protos(&["proto/dataplane.proto"], &["proto"])?;
    Ok(())
}
