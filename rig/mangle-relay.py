#!/usr/bin/python3
"""A SPICE relay that is NOT byte-transparent, for testing detection of such proxies.

Some SPICE proxies parse the stream and insert their own messages toward the client (and
swallow the matching ACKs). This one forwards client -> server bytes unchanged and, on display
channels, inserts an empty DISPLAY_MARK (type 102) toward the client after every
--every server messages, at most --max times per connection (default once). Plain TCP, no
TLS, ticket auth (spice-gtk + Xspice/QEMU as the rig runs them); mini headers only.

Why at most once by default: the client counts inserted messages toward its ACK cadence, so
each insertion makes it ACK one message early. One early ACK leaves spice-server's count at 0
after each ACK; two or more would drive its unsigned count below zero (spice-server has no
lower-bound check) and stall the channel for good, unless the proxy also re-times the ACKs.

  rig/mangle-relay.py --listen 127.0.0.1:6960 --server 127.0.0.1:5960 [--every 50] [--max 1] [--pidfile F]

Prints "listening" once ready. Stop it with SIGTERM.
"""
import argparse
import asyncio
import os
import signal
import struct
import sys

DISPLAY = 2
MARK = struct.pack('<HI', 102, 0)


async def pipe(reader, writer):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


class Mangler:
    """Server -> client stream: link reply, link result, then mini-header messages."""

    def __init__(self, channel_type, every, most):
        self.channel_type = channel_type
        self.every = every
        self.most = most
        self.buf = b''
        self.need = 16          # link header first
        self.state = 'header'   # header, reply, result, msghdr, body
        self.count = 0
        self.inserted = 0

    def feed(self, data):
        """Returns the bytes to send toward the client for `data` read from the server."""
        out = bytearray()
        self.buf += data
        while len(self.buf) >= self.need:
            chunk, self.buf = self.buf[:self.need], self.buf[self.need:]
            out += chunk
            if self.state == 'header':
                size = struct.unpack_from('<I', chunk, 12)[0]
                self.state, self.need = 'reply', size
            elif self.state == 'reply':
                self.state, self.need = 'result', 4
            elif self.state == 'result':
                self.state, self.need = 'msghdr', 6
            elif self.state == 'msghdr':
                size = struct.unpack_from('<I', chunk, 2)[0]
                self.count += 1
                if size:
                    self.state, self.need = 'body', size
                else:
                    self._after_message(out)
            else:  # body
                self.state, self.need = 'msghdr', 6
                self._after_message(out)
        # Partial element: forward what we have, keep counting the rest.
        if self.buf and self.state in ('body', 'reply'):
            out += self.buf
            self.need -= len(self.buf)
            self.buf = b''
        return bytes(out)

    def _after_message(self, out):
        if self.channel_type == DISPLAY and self.count % self.every == 0 and self.inserted < self.most:
            out += MARK
            self.inserted += 1


async def server_to_client(reader, writer, mangler):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(mangler.feed(data))
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def handle(creader, cwriter, server, every, most):
    host, port = server.rsplit(':', 1)
    try:
        sreader, swriter = await asyncio.open_connection(host, int(port))
    except OSError:
        cwriter.close()
        return
    # The client's link message: forward it, and learn the channel type (byte 20).
    head = await creader.readexactly(16)
    size = struct.unpack_from('<I', head, 12)[0]
    body = await creader.readexactly(size)
    swriter.write(head + body)
    await swriter.drain()
    mangler = Mangler(body[4], every, most)
    await asyncio.gather(pipe(creader, swriter), server_to_client(sreader, cwriter, mangler))


async def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--listen', required=True)
    ap.add_argument('--server', required=True)
    ap.add_argument('--every', type=int, default=50)
    ap.add_argument('--max', type=int, default=1, help='insertions per connection')
    ap.add_argument('--pidfile')
    a = ap.parse_args()
    host, port = a.listen.rsplit(':', 1)
    srv = await asyncio.start_server(lambda r, w: handle(r, w, a.server, a.every, a.max), host, int(port), reuse_address=True)
    if a.pidfile:
        with open(a.pidfile, 'w') as f:
            f.write(str(os.getpid()))
    print('listening', flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with srv:
        await stop.wait()


if __name__ == '__main__':
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
