/* Closed-loop load generator for bench/bench_cube.py: the same tool drives cube and Redis.
 *
 *   loadgen HOST PORT CLIENTS SECONDS REQUEST_FILE LATENCY_OUT
 *
 * REQUEST_FILE: uint32 count, then per request: uint32 request length,
 * uint32 answer length, the request bytes. The answer lengths are learned
 * beforehand (bench_cube.py asks every request once), so the generator never
 * parses an answer: it only counts bytes. That keeps its cost per request to
 * a send and a receive, the same for both peers whatever their protocol.
 * Each of CLIENTS keep-alive connections sends its next request when the
 * previous answer is complete; no new request starts after SECONDS.
 * Prints "requests elapsed_seconds"; writes each request's latency (uint32
 * nanoseconds, capped) to LATENCY_OUT.
 *
 * An answer length of 0 means "an HTTP/1.1 answer": its length is read from
 * its Content-Length header (bench_serving.py: merged batches make the
 * digits of a prediction, and so an answer's length, vary from run to run).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef struct { uint32_t len, answer; const char *data; } request_t;
typedef struct { int fd; uint64_t next, got, want; double t0; int active, http; size_t head_len; char head[8192]; } conn_t;

/* HTTP mode: the whole answer's length once its head is in, else 0 (need more bytes). */
static uint64_t http_answer_length(conn_t *c) {
    c->head[c->head_len < sizeof c->head ? c->head_len : sizeof c->head - 1] = 0;
    char *end = strstr(c->head, "\r\n\r\n");
    if (!end) {
        if (c->head_len >= sizeof c->head - 1) { fprintf(stderr, "loadgen: answer head too long\n"); exit(1); }
        return 0;
    }
    for (char *p = c->head; p < end; p++) {
        if ((p == c->head || p[-1] == '\n') && strncasecmp(p, "content-length:", 15) == 0)
            return (uint64_t)(end + 4 - c->head) + strtoull(p + 15, NULL, 10);
    }
    fprintf(stderr, "loadgen: answer without Content-Length\n");
    exit(1);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what) { perror(what); exit(1); }

static void send_all(int fd, const char *p, size_t n) {
    while (n) {  /* requests are small: a blocking-style retry on a full buffer is fine */
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0) { if (errno == EAGAIN || errno == EINTR) continue; die("send"); }
        p += k; n -= (size_t)k;
    }
}

int main(int argc, char **argv) {
    if (argc != 7) { fprintf(stderr, "usage: loadgen HOST PORT CLIENTS SECONDS REQUEST_FILE LATENCY_OUT\n"); return 2; }
    int clients = atoi(argv[3]);
    double seconds = atof(argv[4]);
    FILE *f = fopen(argv[5], "rb");
    if (!f) die("request file");
    fseek(f, 0, SEEK_END); long size = ftell(f); fseek(f, 0, SEEK_SET);
    char *blob = malloc((size_t)size);
    if (fread(blob, 1, (size_t)size, f) != (size_t)size) die("read request file");
    fclose(f);
    uint32_t count; memcpy(&count, blob, 4);
    request_t *reqs = calloc(count, sizeof *reqs);
    size_t at = 4;
    for (uint32_t i = 0; i < count; i++) {
        memcpy(&reqs[i].len, blob + at, 4); memcpy(&reqs[i].answer, blob + at + 4, 4);
        reqs[i].data = blob + at + 8; at += 8 + reqs[i].len;
    }
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[2]))};
    inet_pton(AF_INET, argv[1], &addr.sin_addr);
    int ep = epoll_create1(0);
    conn_t *conns = calloc((size_t)clients, sizeof *conns);
    size_t lat_cap = 1 << 20, lat_n = 0;
    uint32_t *lat = malloc(lat_cap * sizeof *lat);
    static char buf[1 << 20];
    double start = now(), end = start + seconds;
    for (int c = 0; c < clients; c++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) die("connect");
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        conns[c] = (conn_t){.fd = fd, .next = (uint64_t)c * 7919u, .active = 1};
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &conns[c]};
        epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    }
    start = now(); end = start + seconds;
    for (int c = 0; c < clients; c++) {
        request_t *r = &reqs[conns[c].next % count];
        conns[c].want = r->answer; conns[c].got = 0; conns[c].t0 = now();
        conns[c].http = r->answer == 0; conns[c].head_len = 0;
        send_all(conns[c].fd, r->data, r->len);
    }
    int active = clients;
    uint64_t done = 0;
    struct epoll_event events[256];
    while (active) {
        int n = epoll_wait(ep, events, 256, 10000);
        if (n == 0) { fprintf(stderr, "loadgen: no answer for 10 s\n"); return 1; }
        if (n < 0) { if (errno == EINTR) continue; die("epoll_wait"); }
        for (int e = 0; e < n; e++) {
            conn_t *c = events[e].data.ptr;
            ssize_t k = recv(c->fd, buf, sizeof buf, 0);
            if (k == 0) { fprintf(stderr, "loadgen: the server closed a connection\n"); return 1; }
            if (k < 0) { if (errno == EAGAIN || errno == EINTR) continue; die("recv"); }
            if (c->http && c->want == 0) {
                size_t room = sizeof c->head - 1 - c->head_len, take = (size_t)k < room ? (size_t)k : room;
                memcpy(c->head + c->head_len, buf, take);
                c->head_len += take;
                c->want = http_answer_length(c);
            }
            c->got += (uint64_t)k;
            if (c->want == 0 || c->got < c->want) continue;
            if (c->got > c->want) { fprintf(stderr, "loadgen: answer longer than expected\n"); return 1; }
            double t = now(), l = (t - c->t0) * 1e9;
            if (lat_n == lat_cap) { lat_cap *= 2; lat = realloc(lat, lat_cap * sizeof *lat); }
            lat[lat_n++] = l > 4e9 ? 4000000000u : (uint32_t)l;
            done++;
            if (t < end) {
                c->next += (uint64_t)clients;
                request_t *r = &reqs[c->next % count];
                c->want = r->answer; c->got = 0; c->t0 = t;
                c->http = r->answer == 0; c->head_len = 0;
                send_all(c->fd, r->data, r->len);
            } else {
                close(c->fd); c->active = 0; active--;
            }
        }
    }
    double elapsed = now() - start;
    FILE *out = fopen(argv[6], "wb");
    if (!out || fwrite(lat, sizeof *lat, lat_n, out) != lat_n) die("latency file");
    fclose(out);
    printf("%llu %.6f\n", (unsigned long long)done, elapsed);
    return 0;
}
