fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A vendored protoc, so a fresh machine needs nothing installed to build.
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&["proto/node.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/node.proto");
    Ok(())
}
