tonic::include_proto!("kvwarden.node.v1");
