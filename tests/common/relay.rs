//! A TCP relay on a loopback port of its own in front of one upstream
//! instance, which a test stops (the port refuses connections and the open
//! ones are cut, as when the instance's process dies) and starts again on
//! the same port (the instance restarted), without touching the instance.

use std::net::SocketAddr;

use anyhow::Context as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

/// See the module documentation. Dropping it stops it.
pub struct Relay {
    addr: SocketAddr,
    target: SocketAddr,
    /// The accept loop and every relayed connection; empty while stopped.
    tasks: Option<JoinSet<()>>,
}

impl Relay {
    /// Relays an ephemeral loopback port to `target`.
    pub async fn start(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let mut relay = Relay {
            addr: listener.local_addr()?,
            target,
            tasks: None,
        };
        relay.serve(listener);
        Ok(relay)
    }

    /// Where clients connect (the instance's address as Envoy knows it).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes the port and cuts every relayed connection.
    pub async fn stop(&mut self) {
        // Aborted tasks drop their sockets when they next run: wait for that,
        // so that a connection made after this returns is refused, not
        // accepted and then cut.
        if let Some(mut tasks) = self.tasks.take() {
            tasks.shutdown().await;
        }
    }

    /// Listens on the same port again (after [`Relay::stop`]).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        let listener = TcpListener::bind(self.addr)
            .await
            .with_context(|| format!("binding {} again", self.addr))?;
        self.serve(listener);
        Ok(())
    }

    fn serve(&mut self, listener: TcpListener) {
        let target = self.target;
        let mut tasks = JoinSet::new();
        let (connections, mut incoming) = tokio::sync::mpsc::unbounded_channel();
        tasks.spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if connections.send(client).is_err() {
                    return;
                }
            }
        });
        // Connections join the set through this loop, so stopping the relay
        // aborts them with the listener.
        let mut relayed = JoinSet::new();
        tasks.spawn(async move {
            while let Some(client) = incoming.recv().await {
                relayed.spawn(relay_one(client, target));
                while relayed.try_join_next().is_some() {}
            }
        });
        self.tasks = Some(tasks);
    }
}

async fn relay_one(mut client: TcpStream, target: SocketAddr) {
    if let Ok(mut upstream) = TcpStream::connect(target).await {
        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
    }
}
