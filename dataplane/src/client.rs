//! A gRPC client for the root daemon over its Unix socket, for the CLI, the user
//! daemon and tests. I/O: one Unix stream connection per channel.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use kvpn_proto::dataplane::dataplane_client::DataplaneClient;
use tonic::transport::{Channel, Endpoint};

/// Connect to the daemon's socket at `socket` (e.g. `/run/kvpn/dataplane.sock`).
///
/// The URI is a placeholder required by tonic; every connection goes to the
/// socket.
pub async fn connect(socket: &Path) -> Result<DataplaneClient<Channel>, tonic::transport::Error> {
    let socket: PathBuf = socket.to_owned();
    let channel = Endpoint::from_static("http://kvpn-dataplane.invalid")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await?;
    Ok(DataplaneClient::new(channel))
}
