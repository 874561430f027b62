// The floor of a tiny one-shot exchange on this machine, without the library: two processes
// (fork, one shared page) pinned to CPUs 0 and 1 exchange S bytes per iteration through records
// laid out as the library's (direct/shm.rs: data right-aligned to byte 160 of a 256-byte record,
// the event number at 184, written SeqCst after the data; two records per rank by parity), poll
// the peer's event, and sum both records' data. Prints rank 0's mean and percentiles per exchange
// (rdtsc at 2.596 GHz, this VM's; `grep MHz /proc/cpuinfo`). A measurement tool, not built by CI.
//   gcc -O2 -march=native -pthread scripts/tiny_floor.c -o target/tiny_floor
//   target/tiny_floor BYTES MODE [ITERS] [PIN]   (BYTES <= 160, a multiple of 4)
// MODE 0: polling without prefetch; 1: also prefetch the record's two data lines while
// polling (as the library does); 2: a flag in every line (LL128-like, 56 data bytes a line);
// 3: mode 0 with a Release store instead of SeqCst (no fence).
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <x86intrin.h>
static int S, MODE, ITERS;
static unsigned char (*rec)[2][256];
static _Alignas(4096) unsigned char pad[4096];
static unsigned long long *tt[2];
static int cmpu(const void*a,const void*b){unsigned long long x=*(unsigned long long*)a,y=*(unsigned long long*)b;return x<y?-1:x>y;}
#include <sys/mman.h>
#include <unistd.h>
#include <sys/wait.h>
static int PIN=1;
#define EV(r,p) ((_Atomic uint64_t*)(rec[r][p]+184))
#define LF(r,p,l) ((_Atomic uint64_t*)(rec[r][p]+64*(l)+56))
static void *run(void *arg){
  int me=(int)(long)arg, pe=1-me;
  if(PIN){cpu_set_t c; CPU_ZERO(&c); CPU_SET(me,&c); sched_setaffinity(0,sizeof c,&c);}
  float in[64], out[64]; for(int j=0;j<64;j++) in[j]=j+me;
  int nl = (S+55)/56; // per-line flag lines
  for(long i=1;i<=ITERS;i++){
    unsigned long long t0=__rdtsc();
    int p=i&1; unsigned char *r=rec[me][p], *q=rec[pe][p];
    if(MODE<2||MODE==3){
      memcpy(r+160-S, in, S);
      if(MODE==3) atomic_store_explicit(EV(me,p), i, memory_order_release); else atomic_store_explicit(EV(me,p), i, memory_order_seq_cst);
      while(atomic_load_explicit(EV(pe,p),memory_order_acquire)<(uint64_t)i){
        if(MODE==1){_mm_prefetch((const char*)q,_MM_HINT_T0);_mm_prefetch((const char*)q+64,_MM_HINT_T0);}
        _mm_pause();
      }
      const float *x=(const float*)(q+160-S);
      for(int j=0;j<S/4;j++) out[j]=in[j]+x[j];
    } else {
      // per-line flags: line l holds bytes 56l..56l+56 then flag
      for(int l=0;l<nl;l++){ int b=56*l, k=S-b<56?S-b:56; memcpy(r+64*l,(char*)in+b,k); atomic_store_explicit(LF(me,p,l), i, memory_order_release);}
      atomic_thread_fence(memory_order_seq_cst);
      for(;;){ int ok=1; for(int l=0;l<nl;l++) ok &= atomic_load_explicit(LF(pe,p,l),memory_order_acquire)>=(uint64_t)i; if(ok)break; _mm_pause(); }
      float tmp[64]; for(int l=0;l<nl;l++){ int b=56*l, k=S-b<56?S-b:56; memcpy((char*)tmp+b,q+64*l,k);} 
      for(int j=0;j<S/4;j++) out[j]=in[j]+tmp[j];
    }
    in[0]=out[0]*0.5f;
    tt[me][i-1]=__rdtsc()-t0;
  }
  return 0;
}
int main(int argc,char**argv){
  S=atoi(argv[1]); MODE=atoi(argv[2]); ITERS=argc>3?atoi(argv[3]):200000;
  for(int r=0;r<2;r++) tt[r]=calloc(ITERS,8);
  PIN=argc>4?atoi(argv[4]):1;
  rec=mmap(0,4096,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
  pid_t k=fork(); if(k==0){ run((void*)1); _exit(0);} run((void*)0); waitpid(k,0,0);
  unsigned long long sum=0; for(int i=0;i<ITERS;i++) sum+=tt[0][i];
  qsort(tt[0],ITERS,8,cmpu);
  printf("mean %.0f S=%4d mode=%d p10 %.0f med %.0f p90 %.0f ns\n",sum/2.596/ITERS,S,MODE,tt[0][ITERS/10]/2.596,tt[0][ITERS/2]/2.596,tt[0][ITERS*9/10]/2.596);
}
