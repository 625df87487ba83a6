//! The `multilora serve` process of the CLI's tests: started on a free port with the API key
//! `test-key`, its stderr echoed and kept, stopped by a signal; and raw HTTP/1.1 requests to it
//! (no client library needed).
#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The PEFT fixtures: `base/` (a tiny Llama) and `adapters/`.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/peft-tiny")
}

/// A `multilora serve` process on a free port, and the address it printed.
pub struct Serve {
    pub child: Child,
    pub url: String,
    /// Every line it wrote to stderr so far.
    pub lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    _stderr: std::thread::JoinHandle<()>,
}

/// `multilora serve --model <model> --port 0 --api-key test-key <args>`, its stderr echoed and
/// kept (`lines`).
pub fn serve_model(model: &Path, args: &[String], env: &[(&str, &str)]) -> Serve {
    serve_model_on(0, model, args, env)
}

/// [`serve_model`] on loopback port `port` (0: a free one), as a restarted replica takes its
/// old address again.
pub fn serve_model_on(port: u16, model: &Path, args: &[String], env: &[(&str, &str)]) -> Serve {
    let port = port.to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_multilora"))
        .args(["serve", "--model", model.to_str().expect("utf-8 path"), "--port", &port, "--api-key", "test-key"])
        .args(args)
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("start multilora serve");
    let stderr = child.stderr.take().expect("stderr piped");
    let (tx, rx) = std::sync::mpsc::channel();
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = lines.clone();
    let reader = std::thread::spawn(move || forward(stderr, tx, kept));
    let line = rx.recv_timeout(Duration::from_secs(60)).expect("multilora serve printed its address");
    let url = line.rsplit(' ').next().expect("an address").to_string();
    assert!(url.starts_with("http://127.0.0.1:"), "{line}");
    Serve { child, url, lines, _stderr: reader }
}

/// Sends the "serving ... on URL" line to `tx`, keeps every line in `kept`, and echoes them for
/// the test log.
fn forward(
    stderr: ChildStderr,
    tx: std::sync::mpsc::Sender<String>,
    kept: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
) {
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        eprintln!("[serve] {line}");
        if line.starts_with("multilora serving") {
            let _ = tx.send(line.clone());
        }
        kept.lock().expect("lines").push(line);
    }
}

impl Serve {
    /// SIGTERM, then the exit status (within 30 s).
    pub fn terminate(mut self) -> ExitStatus {
        self.signal("TERM");
        self.wait_exit(Duration::from_secs(30))
    }

    /// Sends signal `name` (`TERM`, `KILL`, …) to the process.
    pub fn signal(&self, name: &str) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args([&format!("-{name}"), &pid]).status().expect("run kill");
        assert!(sent.success(), "kill -{name} {pid}");
    }

    /// The exit status, waiting at most `within`.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(start.elapsed() < within, "no exit within {within:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

// A test that fails half-way leaves no server running.
impl Drop for Serve {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A raw HTTP/1.1 GET: the whole response.
pub fn get(url: &str, path: &str) -> String {
    try_get(url, path).unwrap_or_else(|e| panic!("GET {url}{path}: {e}"))
}

/// [`get`], or the error when nothing answers at `url`.
pub fn try_get(url: &str, path: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let addr = url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer test-key\r\nConnection: close\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// A raw HTTP/1.1 POST (no client library needed): the whole response, headers included.
pub fn post(url: &str, path: &str, body: &str) -> String {
    use std::io::{Read, Write};
    let addr = url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer test-key\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The status code of a raw response (0 when there is none).
pub fn status(resp: &str) -> u16 {
    resp.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

/// The body of a raw response.
pub fn body(resp: &str) -> &str {
    resp.split_once("\r\n\r\n").map_or("", |(_, b)| b)
}

/// A streamed response read as it arrives. The request is HTTP/1.0, so the body comes without
/// chunked framing (it ends when the connection closes) and SSE lines are read as they are.
pub struct Stream {
    reader: BufReader<std::net::TcpStream>,
    /// The response's status code.
    pub status: u16,
}

impl Stream {
    /// POSTs `body` to `path` of `url` (with the API key) and reads the response head.
    pub fn open(url: &str, path: &str, body: &str) -> std::io::Result<Stream> {
        use std::io::Write;
        let addr = url.trim_start_matches("http://");
        let mut s = std::net::TcpStream::connect(addr)?;
        write!(
            s,
            "POST {path} HTTP/1.0\r\nHost: {addr}\r\nAuthorization: Bearer test-key\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut reader = BufReader::new(s);
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let status = status(&line);
        loop {
            line.clear();
            if reader.read_line(&mut line)? == 0 || line == "\r\n" {
                break;
            }
        }
        Ok(Stream { reader, status })
    }

    /// The next SSE `data:` payload, or the next line of a body that is not SSE; `None` at the
    /// end of the body or when the connection broke.
    pub fn next_data(&mut self) -> Option<String> {
        let mut line = String::new();
        loop {
            line.clear();
            match self.reader.read_line(&mut line) {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            }
            let line = line.trim_end();
            if line.is_empty() {
                continue;
            }
            return Some(line.strip_prefix("data: ").unwrap_or(line).to_string());
        }
    }

    /// The rest of the payloads, up to the end of the body.
    pub fn rest(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.next_data()).collect()
    }
}

/// Whether `python3` can import `modules` (comma-separated) here; fails when CI requires the
/// Python clients (`MULTILORA_REQUIRE_OPENAI=1`), else says the check is skipped.
pub fn python_has(modules: &str) -> bool {
    let ok = Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let required = std::env::var("MULTILORA_REQUIRE_OPENAI").is_ok_and(|v| v == "1");
        assert!(!required, "MULTILORA_REQUIRE_OPENAI=1 but `python3 -c 'import {modules}'` fails");
        eprintln!("SKIPPED the Python client checks: `pip install {}` to run them (CI does)", modules.replace(',', ""));
    }
    ok
}
