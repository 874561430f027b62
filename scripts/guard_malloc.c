// A malloc for hunting writes into freed memory that no in-process sanitizer sees: every
// allocation of at least GUARD_MALLOC_MIN bytes (default 16) gets pages of its own, ending
// against an inaccessible page, and on free its pages are released and made inaccessible
// (PROT_NONE) for the next GUARD_MALLOC_QUARANTINE frees (default 20000) before they are
// unmapped. So
//
//   - a write or read of freed memory by this process faults at once (SIGSEGV where it
//     happens), whatever code makes it: Rust, the C++ backend, torch, gloo, none of them
//     instrumented;
//   - a write or read of it made by the kernel for another process (process_vm_writev or
//     process_vm_readv by a peer rank, which no sanitizer of this process can see) fails in
//     that process with EFAULT, which oxccl reports as an error naming the call;
//   - a write past the end of an allocation faults too (the page after it).
//
// Smaller allocations, realloc of glibc's chunks and alignments above a page go to glibc
// (__libc_malloc and its kin). It is slow (a system call per allocation) and meant for
// debugging runs only: scripts/sanitize_torch.sh builds it into target/ and preloads it
// (LD_PRELOAD) into the ranks of its `guard` runs. Each allocation is a mapping of its own,
// so vm.max_map_count bounds how many may live at once (the script raises it as root).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);
extern void __libc_free(void*);

#define PAGE 4096UL

struct entry {
  uintptr_t ptr;  // the user pointer (0: empty slot; 1: deleted)
  uintptr_t base;
  size_t maplen;
  size_t size;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct entry* table;  // open addressing, by user pointer
static size_t table_cap;     // a power of two
static size_t table_used;    // live + deleted slots
static uintptr_t* quarantine;  // (base, maplen) pairs, a ring
static size_t q_cap, q_head, q_len;
static size_t min_size = 16;
static int ready;

static void init_locked(void) {
  if (ready) return;
  const char* m = getenv("GUARD_MALLOC_MIN");
  if (m) min_size = strtoul(m, NULL, 0);
  const char* q = getenv("GUARD_MALLOC_QUARANTINE");
  q_cap = q ? strtoul(q, NULL, 0) : 20000;
  if (q_cap == 0) q_cap = 1;
  quarantine = mmap(NULL, q_cap * 2 * sizeof(uintptr_t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  table_cap = 1 << 20;
  table = mmap(NULL, table_cap * sizeof(struct entry), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (quarantine == MAP_FAILED || table == MAP_FAILED) abort();
  ready = 1;
}

static size_t slot_of(uintptr_t p) { return (p >> 4) * 0x9E3779B97F4A7C15ULL >> 20 & (table_cap - 1); }

static void insert_locked(struct entry e);

// Rehashes without the deleted slots, into a table twice the size only when the live entries
// fill more than a quarter of it. An insert reuses a deleted slot only where its probe meets
// one; slots filled and freed by addresses that do not come back would otherwise make the
// table double while few entries live.
static void rehash_locked(void) {
  struct entry* old = table;
  size_t old_cap = table_cap, live = 0;
  for (size_t i = 0; i < old_cap; i++) live += old[i].ptr > 1;
  if (live * 4 > old_cap) table_cap *= 2;
  table = mmap(NULL, table_cap * sizeof(struct entry), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (table == MAP_FAILED) abort();
  table_used = 0;
  for (size_t i = 0; i < old_cap; i++)
    if (old[i].ptr > 1) insert_locked(old[i]);
  munmap(old, old_cap * sizeof(struct entry));
}

static void insert_locked(struct entry e) {
  if ((table_used + 1) * 2 > table_cap) rehash_locked();
  size_t i = slot_of(e.ptr);
  while (table[i].ptr > 1) i = (i + 1) & (table_cap - 1);
  if (table[i].ptr == 0) table_used++;
  table[i] = e;
}

// The entry of `p`, or NULL when glibc allocated it.
static struct entry* find_locked(uintptr_t p) {
  if (!ready) return NULL;
  size_t i = slot_of(p);
  while (table[i].ptr != 0) {
    if (table[i].ptr == p) return &table[i];
    i = (i + 1) & (table_cap - 1);
  }
  return NULL;
}

static void* guarded(size_t size, size_t align) {
  if (align < 16) align = 16;
  size_t data = (size + PAGE - 1) & ~(PAGE - 1);
  if (data == 0) data = PAGE;
  size_t maplen = data + PAGE;  // the last page stays inaccessible
  char* base = mmap(NULL, maplen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    errno = ENOMEM;
    return NULL;
  }
  if (mprotect(base + data, PAGE, PROT_NONE) != 0) {
    munmap(base, maplen);
    errno = ENOMEM;
    return NULL;
  }
  uintptr_t p = ((uintptr_t)base + data - size) & ~(uintptr_t)(align - 1);
  pthread_mutex_lock(&lock);
  init_locked();
  insert_locked((struct entry){p, (uintptr_t)base, maplen, size});
  pthread_mutex_unlock(&lock);
  return (void*)p;
}

static int wanted(size_t size, size_t align) {
  if (align > PAGE) return 0;
  if (!ready) {
    pthread_mutex_lock(&lock);
    init_locked();
    pthread_mutex_unlock(&lock);
  }
  return size >= min_size;
}

void* malloc(size_t size) { return wanted(size, 16) ? guarded(size, 16) : __libc_malloc(size); }

void* calloc(size_t n, size_t size) {
  size_t total;
  if (__builtin_mul_overflow(n, size, &total)) {
    errno = ENOMEM;
    return NULL;
  }
  return wanted(total, 16) ? guarded(total, 16) : __libc_calloc(n, size);  // fresh pages are zero
}

int posix_memalign(void** out, size_t align, size_t size) {
  if (align < sizeof(void*) || (align & (align - 1))) return EINVAL;
  void* p = wanted(size, align) ? guarded(size, align) : __libc_memalign(align, size);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}

void* memalign(size_t align, size_t size) { return wanted(size, align) ? guarded(size, align) : __libc_memalign(align, size); }
void* aligned_alloc(size_t align, size_t size) { return memalign(align, size); }
void* valloc(size_t size) { return memalign(PAGE, size); }
void* pvalloc(size_t size) { return memalign(PAGE, (size + PAGE - 1) & ~(PAGE - 1)); }

void free(void* ptr) {
  if (!ptr) return;
  pthread_mutex_lock(&lock);
  struct entry* e = find_locked((uintptr_t)ptr);
  if (!e) {
    pthread_mutex_unlock(&lock);
    __libc_free(ptr);
    return;
  }
  uintptr_t base = e->base;
  size_t maplen = e->maplen;
  e->ptr = 1;  // deleted
  // Released and made inaccessible: any later access faults (or fails with EFAULT when the
  // kernel makes it for another process).
  madvise((void*)base, maplen, MADV_DONTNEED);
  mprotect((void*)base, maplen, PROT_NONE);
  if (q_len == q_cap) {
    size_t o = q_head;
    munmap((void*)quarantine[2 * o], quarantine[2 * o + 1]);
    q_head = (q_head + 1) % q_cap;
    q_len--;
  }
  size_t at = (q_head + q_len) % q_cap;
  quarantine[2 * at] = base;
  quarantine[2 * at + 1] = maplen;
  q_len++;
  pthread_mutex_unlock(&lock);
}

void* realloc(void* ptr, size_t size) {
  if (!ptr) return malloc(size);
  pthread_mutex_lock(&lock);
  struct entry* e = find_locked((uintptr_t)ptr);
  size_t old = e ? e->size : 0;
  pthread_mutex_unlock(&lock);
  if (!e) return __libc_realloc(ptr, size);
  void* p = malloc(size);
  if (!p) return NULL;
  memcpy(p, ptr, old < size ? old : size);
  free(ptr);
  return p;
}

size_t malloc_usable_size(void* ptr) {
  static size_t (*glibc_usable)(void*);
  if (!ptr) return 0;
  pthread_mutex_lock(&lock);
  struct entry* e = find_locked((uintptr_t)ptr);
  size_t size = e ? e->size : 0;
  pthread_mutex_unlock(&lock);
  if (e) return size;
  if (!glibc_usable) glibc_usable = (size_t(*)(void*))dlsym(RTLD_NEXT, "malloc_usable_size");
  return glibc_usable ? glibc_usable(ptr) : 0;
}

// A forked child must not inherit the lock held by another thread of its parent.
static void before_fork(void) { pthread_mutex_lock(&lock); }
static void after_fork(void) { pthread_mutex_unlock(&lock); }
static void child_after_fork(void) { pthread_mutex_init(&lock, NULL); }
__attribute__((constructor)) static void setup(void) {
  pthread_atfork(before_fork, after_fork, child_after_fork);
}
